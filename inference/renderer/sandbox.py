"""The Jinja2 sandbox chat templates run in (untrusted code, DESIGN.md §4).

Behaviour visible to a well-behaved template is that of transformers 5.24's chat-template
environment (``transformers/utils/chat_template_utils.py::_cached_compile_jinja_template``):
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the ``loopcontrols``
extension and a ``{% generation %}...{% endgeneration %}`` tag (renders its body), a ``tojson``
filter that does not HTML-escape (``ensure_ascii=False`` by default; ``indent``, ``separators``,
``sort_keys`` accepted), and globals ``raise_exception(msg)``, ``strftime_now(fmt)`` (local time),
``dict(...)`` and a ``namespace(...)`` that refuses underscore-prefixed names.

What we add, for templates that are not well-behaved:

* Unsafe attribute access (``__class__``, ``__globals__``, ``mro``, ``func_globals``, mutating
  methods of list/dict...) raises ``TemplateSecurityError`` at the access (Jinja's default returns
  an undefined that renders as "" in some positions; we fail loudly instead).
* An operation budget: every loop iteration, call, filter and intercepted binary operator costs 1;
  past ``max_ops`` the render fails with ``TemplateLimitError``. Loops are counted by rewriting each
  ``{% for %}``'s iterable, at parse time, into ``environment.loop_guard(iterable)``, a name the
  template cannot reach or shadow.
* A size cap on every intermediate string/list built by ``*``, ``+``, ``%``, ``~``, calls and
  filters (``max_chars``), and on the rendered output (checked chunk by chunk by the caller).
* ``range`` is capped by Jinja's sandbox (``MAX_RANGE`` = 100000 items per call).

Budgets are per render, held in a ``ContextVar`` so one compiled template is shared by threads.
"""

from __future__ import annotations

import functools
import json
import math
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.visitor
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import TemplateLimitError, TemplateSecurityError


class RenderBudget:
    """Mutable per-render counters: ``ops`` used so far, limits ``max_ops`` and ``max_chars``."""

    __slots__ = ("ops", "max_ops", "max_chars")

    def __init__(self, max_ops: int, max_chars: int):
        self.ops = 0
        self.max_ops = max_ops
        self.max_chars = max_chars

    def spend(self, n: int = 1) -> None:
        """Count ``n`` operations; raise ``TemplateLimitError`` past ``max_ops``."""
        self.ops += n
        if self.ops > self.max_ops:
            raise TemplateLimitError(
                f"chat template exceeded its operation budget ({self.max_ops} loop iterations/calls)"
            )

    def check_size(self, value: Any) -> Any:
        """Raise ``TemplateLimitError`` if ``value`` is a str/list/tuple/dict longer than ``max_chars``."""
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.max_chars:
            raise TemplateLimitError(
                f"chat template built a value of {len(value)} items, over the limit of {self.max_chars}"
            )
        return value


_BUDGET: ContextVar[RenderBudget | None] = ContextVar("chat_template_budget", default=None)


def activate_budget(budget: RenderBudget):
    """Make ``budget`` the current one; returns the token for ``deactivate_budget``."""
    return _BUDGET.set(budget)


def deactivate_budget(token) -> None:
    """Restore the budget that was current before ``activate_budget``."""
    _BUDGET.reset(token)


class GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders the body (transformers uses it to build
    assistant masks, which a server does not need)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates, without exposing the ``dict`` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` refusing underscore-prefixed attribute names (as transformers does)."""

    def __init__(*args, **kwargs):  # noqa: N805 - same signature trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


def _guard_filter(f):
    @functools.wraps(f)  # copies jinja_pass_arg, so pass_context/pass_eval_context still work
    def guarded(*args, **kwargs):
        budget = _BUDGET.get()
        if budget is not None:
            budget.spend()
        result = f(*args, **kwargs)
        if budget is not None:
            budget.check_size(result)
        return result

    return guarded


_MAX_POW_BITS = 4096


class ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """The sandboxed environment described in the module docstring."""

    intercepted_binops = frozenset(["*", "**", "+", "%", "//"])

    def __init__(self):
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[GenerationTag, jinja2.ext.loopcontrols],
        )
        self.filters["tojson"] = _tojson
        self.filters = {name: _guard_filter(f) for name, f in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _TemplateDict()
        self.globals["namespace"] = _TemplateNamespace

    # -- sandbox escapes fail loudly ----------------------------------------------------------
    def unsafe_undefined(self, obj, attribute):
        raise TemplateSecurityError(
            f"chat template accessed unsafe attribute {attribute!r} of {type(obj).__name__!r}"
        )

    # -- budgeted operations ------------------------------------------------------------------
    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        budget = _BUDGET.get()
        if budget is not None:
            budget.spend()
        result = super().call(__context, __obj, *args, **kwargs)
        if budget is not None:
            budget.check_size(result)
        return result

    def call_binop(self, context, op, left, right):
        budget = _BUDGET.get()
        if budget is not None:
            budget.spend()
            limit = budget.max_chars
            if op == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * max(n, 0) > limit:
                        raise TemplateLimitError(
                            f"chat template built a value of {len(seq) * n} items, over the limit of {limit}"
                        )
            elif op == "**":
                if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                    if right * math.log2(abs(left)) > _MAX_POW_BITS:
                        raise TemplateLimitError("chat template computed a number that is too large")
            elif op == "+":
                if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                    if len(left) + len(right) > limit:
                        raise TemplateLimitError(
                            f"chat template built a value of {len(left) + len(right)} items, over the limit of {limit}"
                        )
        result = super().call_binop(context, op, left, right)
        if budget is not None:
            budget.check_size(result)
        return result

    def loop_guard(self, iterable):
        """Wraps every ``{% for %}`` iterable: one budget unit per iteration."""
        budget = _BUDGET.get()
        if budget is None:
            yield from iterable
            return
        for item in iterable:
            budget.spend()
            yield item

    def concat_guard(self, *parts):
        """``a ~ b ~ c`` (Jinja's str_join), with the size cap."""
        result = "".join(map(str, parts))
        budget = _BUDGET.get()
        if budget is not None:
            budget.spend()
            budget.check_size(result)
        return result

    # -- parse-time rewrite -------------------------------------------------------------------
    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        tree = _GuardInserter().visit(tree)
        tree.set_environment(self)
        return tree


class _GuardInserter(jinja2.visitor.NodeTransformer):
    """Wraps ``{% for %}`` iterables in ``environment.loop_guard(...)`` and turns ``a ~ b`` into
    ``environment.concat_guard(a, b)``; the template cannot name ``environment``."""

    def visit_For(self, node):
        node = self.generic_visit(node)
        node.iter = jinja2.nodes.Call(
            jinja2.nodes.EnvironmentAttribute("loop_guard"), [node.iter], [], None, None, lineno=node.lineno
        )
        return node

    def visit_Concat(self, node):
        node = self.generic_visit(node)
        return jinja2.nodes.Call(
            jinja2.nodes.EnvironmentAttribute("concat_guard"), list(node.nodes), [], None, None, lineno=node.lineno
        )
