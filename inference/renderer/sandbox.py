"""The Jinja2 sandbox chat templates run in (untrusted code, docs/ARCHITECTURE.md §4).

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
  Wherever the size of a result can be known from the arguments it is checked BEFORE the result is
  built, so a refused template never allocates it: widths of ``center``, ``indent``,
  ``wordwrap``, ``tojson(indent=...)``, ``batch(fill_with=...)``, printf-style ``%``/``format``
  widths and precisions (``"%100000000s"``), ``str.format`` specs (``"{:>100000000}"``), the
  ``ljust``/``rjust``/``center``/``zfill``/``expandtabs``/``join``/``replace``/``translate``
  methods, ``join``/``replace`` results, and the text of any value turned into a string (output,
  ``~``, ``%``, ``string``...: a list of 100,000 references to one 1 MB string is measured, not
  printed; ``RenderBudget.text_size``).
* Iterable filters (``join``, ``sort``, ``unique``, ``map``, ``select``/``reject``,
  ``selectattr``/``rejectattr``, ``groupby``, ``sum``, ``min``/``max``, ``list``, ``reverse``,
  ``dictsort``, ``batch``, ``slice``, ``items``, ``tojson``...) cost one unit per element they walk,
  not one per call, and iterators they return cost one unit per element produced.
* No compile-time evaluation: Jinja folds constant expressions at compile time, outside any budget
  (``{{ ""|center(100000000) }}`` was built while compiling). The environment is created with
  ``optimized=False`` (no optimizer pass), and every filter and ``finalize`` take the render
  context (``pass_context``), which Jinja never calls at compile time (``nodes.Filter.as_const``
  and ``CodeGenerator.visit_Output`` refuse them); only template text is still folded.
* Calls whose C code costs len(s) x len(argument) (``rfind``/``rindex``/``rsplit``/``rpartition``, ``strip``
  and its kin with a character set) are charged for that before they run; ``sum`` adds numbers only (a sum of
  lists copies its growing total at every item); printf keys are read as Python reads them (``%((x))9s``: key
  ``(x)``, width 9); ``Markup`` values (``|safe``, ``|e``) get the same method and ``format`` checks as ``str``;
  ``strftime_now`` counts glibc's width flags (``%200000000Y``).
* Comparisons that can walk containers (``x in seq``, ``seq1 == seq2``, ``a < b``..., and the tests ``is in``,
  ``equalto``...) are charged before Python runs them: one unit per item compared plus one per 1,000 characters
  (``compare_cost``; ``b in [a] * 200000`` with distinct 1 MB strings was 5 s in one C call). The code generator
  compiles such a comparison to ``environment.compare_guard(...)``; one with a literal on either side (the usual
  ``message.role == "user"``) stays Python's own operator, and numbers and short strings spend nothing. The
  filters that order or hash items (``sort``, ``dictsort``, ``groupby``, ``unique``, ``min``, ``max``) pay for the
  characters their comparisons walk the same way (``_pre_sorting``).
* No bytes: ``int.to_bytes``, ``str.encode`` and every attribute of ``bytes``/``bytearray``/``memoryview`` are unsafe
  attributes. A chat template has no use for bytes, and the size checks above are for text: ``(0).to_bytes(n)``
  built a value of ``n`` bytes past every cap, and ``bytes.count`` over it held a render worker in C code until its
  hard time limit killed it.
* ``range`` is capped by Jinja's sandbox (``MAX_RANGE`` = 100000 items per call, ``OverflowError``
  -> ``TemplateLimitError``); ``lipsum`` is refused past ``max_chars`` estimated characters.

Budgets are per render, held in a ``ContextVar`` so one compiled template is shared by threads.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import operator
import re
import types
from collections.abc import Callable, ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from contextvars import ContextVar, Token
from datetime import datetime
from typing import Any, NoReturn, cast

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.utils
import jinja2.visitor
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import _PassArg

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
        """Raise ``TemplateLimitError`` if ``value`` is a str/bytes/list/tuple/dict longer than ``max_chars``."""
        if isinstance(value, (str, list, tuple, dict, *_BYTES_TYPES)) and len(value) > self.max_chars:
            raise TemplateLimitError(
                f"chat template built a value of {len(value)} items, over the limit of {self.max_chars}"
            )
        return value

    def check_planned(self, n: int, what: str = "value") -> None:
        """Refuse, before it is built, a ``what`` estimated at ``n`` characters/items (> ``max_chars``)."""
        if n > self.max_chars:
            raise TemplateLimitError(
                f"chat template would build a {what} of about {n} characters/items, over the limit of {self.max_chars}"
            )

    def charge_items(self, value: Any) -> Any:
        """One unit per element of ``value`` that a filter will walk: ``len(value)`` at once when it is sized,
        else ``value`` wrapped in a generator paying per element produced. Returns what to pass on."""
        if isinstance(value, (str, list, tuple, dict, set, frozenset, range, KeysView, ValuesView, ItemsView)):
            self.spend(len(value))
            return value
        if isinstance(value, Iterator):
            return self.charged(value)
        return value

    def charged(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """``iterator`` re-yielded at one unit per element."""
        for item in iterator:
            self.spend()
            yield item

    def text_size(self, value: Any, *, json_indent: int = 0, item_sep: int = 2) -> int:
        """Estimated length of ``str(value)`` (``json_indent`` > 0: of ``json.dumps(value, indent=...)``), found
        without building it: strings count their length (+2 quotes inside containers), numbers their digits,
        containers their items plus ``item_sep`` per item (plus a newline and ``json_indent`` x depth when
        indenting). One unit per container item walked; raises ``TemplateLimitError`` as soon as the estimate
        passes ``max_chars`` (shared references are counted each time, as printing repeats them)."""
        if isinstance(value, str):
            self.check_planned(len(value), "string")
            return len(value)
        limit = self.max_chars
        total = 0
        stack = [(value, 0)]
        while stack:
            v, depth = stack.pop()
            if isinstance(v, str):
                total += len(v) + 2
            elif isinstance(v, (bool, type(None))):
                total += 5
            elif isinstance(v, int):
                total += v.bit_length() * 30103 // 100000 + 2
            elif isinstance(v, float):
                total += 24
            elif isinstance(v, (Mapping, ItemsView)):
                items = v.items() if isinstance(v, Mapping) else v
                self.spend(len(items))
                total += 2 + len(items) * (2 * item_sep + (1 + json_indent * (depth + 1) if json_indent else 0))
                for k, x in items:
                    stack.append((k, depth + 1))
                    stack.append((x, depth + 1))
            elif isinstance(v, (list, tuple, set, frozenset, KeysView, ValuesView)):
                self.spend(len(v))
                total += 2 + len(v) * (item_sep + (1 + json_indent * (depth + 1) if json_indent else 0))
                stack.extend((x, depth + 1) for x in v)
            elif isinstance(v, jinja2.utils.Namespace):
                total += 14
                stack.append((object.__getattribute__(v, "_Namespace__attrs"), depth))
            elif isinstance(v, jinja2.Undefined):
                pass
            else:  # functions, loop objects, iterators, ...: a short repr
                total += 80
            if total > limit:
                self.check_planned(total, "string")
        return total


_BUDGET: ContextVar[RenderBudget | None] = ContextVar("chat_template_budget", default=None)


def activate_budget(budget: RenderBudget) -> Token[RenderBudget | None]:
    """Make ``budget`` the current one; returns the token for ``deactivate_budget``."""
    return _BUDGET.set(budget)


def deactivate_budget(token: Token[RenderBudget | None]) -> None:
    """Restore the budget that was current before ``activate_budget``."""
    _BUDGET.reset(token)


class GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders the body (transformers uses it to build
    assistant masks, which a server does not need)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates, without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` refusing underscore-prefixed attribute names (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


# -- filter prechecks: same parameters as Jinja's filters (jinja2/filters.py); each raises
# TemplateLimitError before the filter builds a result over budget.max_chars ---------------------------------
def _pre_center(budget: RenderBudget, value: Any, width: Any = 80) -> None:
    n = budget.text_size(value)
    if isinstance(width, int):
        budget.check_planned(max(n, width), "centered string")


def _pre_indent(budget: RenderBudget, s: Any, width: Any = 4, first: Any = False, blank: Any = False) -> None:
    n = budget.text_size(s)
    lines = s.count("\n") + 1 if isinstance(s, str) else 1
    pad = width if isinstance(width, int) else len(width) if isinstance(width, str) else 0
    budget.check_planned(n + lines * max(pad, 0), "indented string")


def _pre_wordwrap(budget: RenderBudget, s: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None,
                  break_on_hyphens: Any = True) -> None:
    n = budget.text_size(s)
    if isinstance(width, int) and width > 0:
        lines = (s.count("\n") + 1 if isinstance(s, str) else 1) + 2 * n // width + 1
        sep = len(wrapstring) if isinstance(wrapstring, str) else 1
        budget.spend(min(lines, n + 1))
        budget.check_planned(n + min(lines, n + 1) * sep, "wrapped string")


def _pre_tojson(budget: RenderBudget, x: Any, ensure_ascii: Any = False, indent: Any = None, separators: Any = None,
                sort_keys: Any = False) -> None:
    width = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
    budget.check_planned(width, "JSON indentation")
    sep = 2
    if isinstance(separators, (list, tuple)):
        sep = sum(len(p) for p in separators if isinstance(p, str))
    budget.text_size(x, json_indent=max(width, 1) if indent is not None else 0, item_sep=sep)


def _pre_replace(budget: RenderBudget, s: Any, old: Any, new: Any, count: Any = None) -> None:
    n = budget.text_size(s)
    text = s if isinstance(s, str) else None
    o = old if isinstance(old, str) else None
    w = new if isinstance(new, str) else None
    if text is None or o is None or w is None:
        budget.check_planned(n + budget.text_size(new) * (n + 1), "replaced string")
        return
    hits = text.count(o) if o else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    budget.check_planned(n + hits * (len(w) - len(o)), "replaced string")


def _join_items(context: jinja2.runtime.Context, value: Any, args: tuple[Any, ...] | list[Any],
                kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """``join``'s arguments with the items listed and, for ``join(d, attribute)``, looked up first (what
    Jinja's ``do_join`` would join), so the precheck measures the very strings that get joined."""
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset, Mapping, KeysView,
                                                         ValuesView, ItemsView, Iterator)):
        return value, tuple(args), kwargs
    args, kwargs = list(args), dict(kwargs)
    attribute = kwargs.pop("attribute", None)
    if len(args) > 1:
        attribute = args.pop(1)
    value = list(value)
    if attribute is not None:
        value = list(map(jinja2.filters.make_attrgetter(context.environment, attribute), value))
    return value, tuple(args), kwargs


def _pre_join(budget: RenderBudget, value: Any, d: Any = "", attribute: Any = None) -> None:
    # value already charged per element and listed by _join_items: the strings joined must fit max_chars.
    if not isinstance(value, list):
        return
    total = max(len(value) - 1, 0) * budget.text_size(d)
    budget.check_planned(total, "joined string")
    for x in value:
        total += budget.text_size(x)
        budget.check_planned(total, "joined string")


def _pre_batch(budget: RenderBudget, value: Any, linecount: Any, fill_with: Any = None) -> None:
    if fill_with is not None and isinstance(linecount, int):
        budget.check_planned(linecount, "batch")


def _pre_sum(budget: RenderBudget, value: Any, attribute: Any = None, start: Any = 0) -> None:
    # ``sum`` of lists (``start=[]``) copies the growing total at every item: quadratic, in one C call
    if not isinstance(start, (int, float)):
        raise TemplateLimitError("the sum filter adds numbers only (its start was not a number)")


def _pre_format(budget: RenderBudget, value: Any, *args: Any, **kwargs: Any) -> None:
    check_printf(budget, value, kwargs or args)


def _pre_stringify(budget: RenderBudget, value: Any, *args: Any, **kwargs: Any) -> None:
    budget.text_size(value)


def _pre_pprint(budget: RenderBudget, value: Any, *args: Any, **kwargs: Any) -> None:
    budget.check_planned(2 * budget.text_size(value), "pretty-printed string")


def _pre_sorting(budget: RenderBudget, value: Any, *args: Any, **kwargs: Any) -> None:
    """``sort``, ``dictsort``, ``groupby``, ``unique``, ``min``, ``max``: Python orders or hashes the items in one C
    call, each comparison walking as far as the shorter item, each item in about log2(n) of them (once for
    ``min``/``max``/``unique``; without ``case_sensitive`` each string is first copied lowercased): one unit per
    1,000 characters so walked (namespaces' attributes included, for ``attribute=``), charged before
    (``([a] * 40000) | sort`` of a 1 MB string was 22 s; D-298). The per-item unit was paid by ``charge_items``."""
    if isinstance(value, _COMPARED_ITEMWISE) and value:
        size = _compare_size(budget, value)
        budget.spend(size * max(1, len(value).bit_length()) // 1000)


_PRECHECKS: dict[str, Callable[..., None]] = {
    "sort": _pre_sorting,
    "dictsort": _pre_sorting,
    "groupby": _pre_sorting,
    "unique": _pre_sorting,
    "min": _pre_sorting,
    "max": _pre_sorting,
    "center": _pre_center,
    "indent": _pre_indent,
    "wordwrap": _pre_wordwrap,
    "tojson": _pre_tojson,
    "replace": _pre_replace,
    "join": _pre_join,
    "batch": _pre_batch,
    "format": _pre_format,
    "pprint": _pre_pprint,
    "sum": _pre_sum,
}
# Filters that turn their value into a string (soft_str/str): the text is measured first.
for _name in ("capitalize", "e", "escape", "forceescape", "lower", "upper", "title", "trim", "striptags", "string",
              "truncate", "urlize", "urlencode", "wordcount", "safe", "xmlattr", "filesizeformat", "int", "float"):
    _PRECHECKS[_name] = _pre_stringify

# Filters that walk their whole input: one unit per element.
_ITERATING_FILTERS = frozenset({
    "join", "sort", "unique", "map", "select", "reject", "selectattr", "rejectattr", "groupby", "sum", "min",
    "max", "list", "reverse", "dictsort", "batch", "slice", "items", "xmlattr", "urlencode",
})

# On a string (already within max_chars) these run at C speed: not charged per character. Not ``list``: it makes an
# object per character (a 1 MB string outside Latin-1 became ~85 MB per call; D-297), so it pays one unit each.
_C_SPEED_ON_STR = frozenset({"join", "reverse"})

# What follows ``%`` and an optional ``(key)`` in a printf-style conversion.
_PRINTF_REST = re.compile(r"[#0\- +]*(?P<width>\*|\d+)?(?:\.(?P<prec>\*|\d+))?[hlL]?(?P<type>.)", re.S)


def printf_specs(fmt: str) -> Iterator[tuple[str | None, str | None, str | None, str]]:
    """The conversions of printf-style ``fmt`` as ``(key, width, prec, type)`` (``None`` where absent), parsed as
    Python's ``%`` does (``Objects/unicodeobject.c``): a ``(key)`` ends at its matching parenthesis, so
    ``%((x))9s`` has key ``(x)`` and width 9. Stops where ``%`` would raise (an unclosed key, a trailing ``%``)."""
    i, n = 0, len(fmt)
    while (i := fmt.find("%", i)) >= 0:
        i += 1
        key = None
        if i < n and fmt[i] == "(":
            depth, j = 1, i + 1
            while j < n and depth:
                depth += {"(": 1, ")": -1}.get(fmt[j], 0)
                j += 1
            if depth:
                return
            key, i = fmt[i + 1:j - 1], j
        m = _PRINTF_REST.match(fmt, i)
        if m is None:
            return
        yield key, m.group("width"), m.group("prec"), m.group("type")
        i = m.end()


def check_printf(budget: RenderBudget, fmt: Any, args: Any) -> None:
    """Refuse ``fmt % args`` (printf-style, Python's ``%`` rules: a tuple is the argument list, a mapping
    serves ``%(key)s``, anything else is the one argument) when its estimated length passes ``max_chars``:
    the format's own text, each width and precision, and the text of each argument it converts."""
    if not isinstance(fmt, str):
        return
    total = len(fmt)
    budget.check_planned(total, "formatted string")
    if isinstance(args, tuple):
        positional = list(args)
    elif isinstance(args, Mapping):
        positional = [args]
    else:
        positional = [args]
    index = 0
    for key, width, prec, conversion in printf_specs(fmt):
        if conversion == "%":
            continue
        for spec in (width, prec):
            if spec == "*":
                n = positional[index] if index < len(positional) else 0
                index += 1
            else:
                n = int(spec) if spec else 0
            if isinstance(n, int):
                total += abs(n)
                budget.check_planned(total, "formatted string")
        if key is not None and isinstance(args, Mapping):
            value = args.get(key, "")
        else:
            value = positional[index] if index < len(positional) else ""
            index += 1
        total += budget.text_size(value)
        budget.check_planned(total, "formatted string")


def _guard_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` (a Jinja filter) as a ``pass_context`` filter (never folded at compile time) that costs one unit
    plus one per element it walks (``_ITERATING_FILTERS``), runs ``_PRECHECKS[name]`` before ``f`` and checks
    the size of the result (an iterator result pays per element produced)."""
    pass_arg = _PassArg.from_obj(f)
    precheck = _PRECHECKS.get(name)
    iterating = name in _ITERATING_FILTERS

    @functools.wraps(f)
    def guarded(context: jinja2.runtime.Context, value: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.spend()
            if iterating and not (isinstance(value, str) and name in _C_SPEED_ON_STR):
                value = budget.charge_items(value)
            if precheck is _pre_sorting and isinstance(value, Iterator):
                value = list(value)  # what the filter would hold anyway; its items are measured before it orders them
            if name == "join":
                value, args, kwargs = _join_items(context, value, args, kwargs)
            if precheck is not None:
                precheck(budget, value, *args, **kwargs)
        if pass_arg is _PassArg.context:
            result = f(context, value, *args, **kwargs)
        elif pass_arg is _PassArg.eval_context:
            result = f(context.eval_ctx, value, *args, **kwargs)
        elif pass_arg is _PassArg.environment:
            result = f(context.environment, value, *args, **kwargs)
        else:
            result = f(value, *args, **kwargs)
        if budget is not None:
            if isinstance(result, Iterator) and not isinstance(result, str):
                return budget.charged(result)
            budget.check_size(result)
        return result

    return jinja2.pass_context(guarded)


@jinja2.pass_context
def _finalize(context: jinja2.runtime.Context, value: Any) -> Any:
    """Every ``{{ ... }}`` value, before Jinja turns it into a string: its text is measured first."""
    if not isinstance(value, str):
        budget = _BUDGET.get()
        if budget is not None:
            budget.text_size(value)
    return value


class _BudgetedFormatter(SandboxedFormatter):
    """Jinja's sandboxed ``str.format`` formatter, refusing a field (``{:>100000000}``, ``{:.100000000f}``)
    or a running total over ``max_chars`` before it is built."""

    def __init__(self, env: jinja2.Environment, budget: RenderBudget) -> None:
        super().__init__(env)
        self._budget = budget
        self._total = 0

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion is not None:
            self._budget.check_planned(self._total + self._budget.text_size(value), "formatted string")
        return super().convert_field(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> Any:
        budget = self._budget
        budget.spend()
        widths = [int(d) for d in re.findall(r"\d+", format_spec or "")]
        self._total += budget.text_size(value) + sum(widths)
        budget.check_planned(self._total, "formatted string")
        return super().format_field(value, format_spec)


# ``str`` methods whose C code costs up to len(s) x len(first argument) character comparisons.
_QUADRATIC_STR_METHODS = frozenset({"rfind", "rindex", "rsplit", "rpartition", "strip", "lstrip", "rstrip"})
_CHAR_COMPARISONS_PER_OP = 1000


def _check_str_method(budget: RenderBudget, method: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Precheck of a call to a method of a ``str`` or of a subclass such as ``Markup`` (``args``/``kwargs`` as
    given); returns the args to call with."""
    s, name = cast(str, cast(Any, method).__self__), method.__name__  # a bound method of a str (the caller checks)
    if name in ("ljust", "rjust", "center", "zfill"):
        if args and isinstance(args[0], int):
            budget.check_planned(max(len(s), args[0]), "padded string")
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            budget.check_planned(len(s) + s.count("\t") * max(tab, 0), "expanded string")
    elif name == "join" and len(args) == 1 and not kwargs:
        items = budget.charge_items(args[0])
        items = list(items) if not isinstance(items, (list, tuple)) else items
        total = max(len(items) - 1, 0) * len(s)
        budget.check_planned(total, "joined string")
        for x in items:
            total += len(x) if isinstance(x, str) else 0
            budget.check_planned(total, "joined string")
        return (items,)
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        hits = s.count(args[0]) if args[0] else len(s) + 1
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        if isinstance(count, int) and count >= 0:
            hits = min(hits, count)
        budget.check_planned(len(s) + hits * (len(args[1]) - len(args[0])), "replaced string")
    elif name in _QUADRATIC_STR_METHODS and args and isinstance(args[0], str):
        # backward searches compare naively, and strip tests each character against the whole set: one unit per
        # _CHAR_COMPARISONS_PER_OP comparisons of the worst case, before the call (it runs in C, uninterruptible)
        budget.spend(len(s) * len(args[0]) // _CHAR_COMPARISONS_PER_OP)
    elif name in ("startswith", "endswith") and args and isinstance(args[0], tuple):
        # each candidate compared in turn, in C: one unit per candidate and per 1,000 characters of theirs
        budget.spend(len(args[0]) + sum(len(x) for x in args[0] if isinstance(x, str)) // 1000)
    elif name == "translate" and args and isinstance(args[0], Mapping):
        table = args[0]
        total = 0
        for ch, n in collections.Counter(s).items():
            out = table.get(ord(ch), ch)
            total += n * (len(out) if isinstance(out, str) else 1)
            budget.check_planned(total, "translated string")
    return args


def _check_comparing_method(budget: RenderBudget, owner: Any, name: str, args: tuple[Any, ...]) -> None:
    """Charge, before the call, the C comparisons of ``list``/``tuple`` ``count``/``index`` (the argument against
    every item, as ``in``) and of ``loop.changed`` (its arguments against the previous ones, as ``!=``)."""
    if name in ("count", "index") and isinstance(owner, (list, tuple)):
        budget.spend(compare_cost(budget, "in", args[0], owner))
    elif name == "changed" and isinstance(owner, jinja2.runtime.LoopContext):
        budget.spend(compare_cost(budget, "ne", args, getattr(owner, "_last_changed_value", None)))


def _lipsum(n: Any = 5, html: Any = True, min: Any = 20, max: Any = 100) -> str:  # Jinja's parameter names
    budget = _BUDGET.get()
    if budget is not None and isinstance(n, int) and isinstance(max, int):
        budget.check_planned(n * max * 12, "lorem ipsum")
    return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)


# A strftime directive's glibc flags and width (``%200000000Y`` pads to that width).
_STRFTIME_WIDTH = re.compile(r"%[_\-0^#]*(\d+)")


def _strftime_now_budgeted(fmt: Any) -> str:
    budget = _BUDGET.get()
    if budget is not None and isinstance(fmt, str):
        widths = sum(int(w) for w in _STRFTIME_WIDTH.findall(fmt))
        budget.check_planned(len(fmt) + fmt.count("%") * 64 + widths, "date string")
    return _strftime_now(fmt)


_MAX_POW_BITS = 4096
# bytes are unreachable from a template (``ChatTemplateEnvironment.is_safe_attribute``)
_BYTES_TYPES = (bytes, bytearray, memoryview)
_TO_BYTES = frozenset({"to_bytes", "encode"})


class _GuardedCodeGenerator(jinja2.compiler.CodeGenerator):
    """Jinja's code generator, with comparisons (``a in b``, ``a == b``, ``a < b``...) compiled to
    ``environment.compare_guard(("in",), a, b)`` (a direct call: not through the sandbox's ``call``, which would
    charge a unit and cost ~3 µs each) unless every pair is cheap whatever the values (``_cheap_pair``), so the usual
    ``message.role == "user"`` stays Python's own operator."""

    def visit_Compare(self, node: jinja2.nodes.Compare, frame: jinja2.compiler.Frame) -> None:
        left, cheap = node.expr, True
        for operand in node.ops:
            cheap = cheap and _cheap_pair(operand.op, left, operand.expr)
            left = operand.expr
        if cheap:
            super().visit_Compare(node, frame)
            return
        # ``a < b < c`` as Python runs it: ``(a < (t := b)) and (t < c)``, each pair guarded, ``b`` evaluated once
        # and ``c`` only when the first pair held
        self.write("(")
        previous: str | None = None
        for i, operand in enumerate(node.ops):
            if i:
                self.write(" and ")
            self.write(f"environment.compare_guard({operand.op!r}, ")
            if previous is None:
                self.visit(node.expr, frame)
            else:
                self.write(previous)
            self.write(", ")
            if i < len(node.ops) - 1:
                previous = self.temporary_identifier()
                self.write(f"({previous} := ")
                self.visit(operand.expr, frame)
                self.write(")")
            else:
                self.visit(operand.expr, frame)
            self.write(")")
        self.write(")")


class ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """The sandboxed environment described in the module docstring."""

    intercepted_binops = frozenset(["*", "**", "+", "%", "//"])
    code_generator_class = _GuardedCodeGenerator

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[GenerationTag, jinja2.ext.loopcontrols],
            optimized=False,  # no compile-time constant folding (module docstring)
            finalize=_finalize,
        )
        self.filters["tojson"] = _tojson
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        # ``x is in seq``, ``select("equalto", x)``...: charged as the operators are (compare_guard)
        self.tests = {**self.tests, **{name: _guard_test(op, cast(Callable[..., Any], self.tests[name]))
                                       for name, op in _TEST_OPS.items()}}
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now_budgeted
        self.globals["lipsum"] = _lipsum
        self.globals["dict"] = _TemplateDict()
        self.globals["namespace"] = _TemplateNamespace

    # -- sandbox escapes fail loudly ----------------------------------------------------------
    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        """Jinja's rule, and nothing that makes or reads bytes (module docstring)."""
        if isinstance(obj, _BYTES_TYPES) or (attr in _TO_BYTES and isinstance(obj, (int, str))):
            return False
        return bool(super().is_safe_attribute(obj, attr, value))

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise TemplateSecurityError(
            f"chat template accessed unsafe attribute {attribute!r} of {type(obj).__name__!r}"
        )

    # -- budgeted operations ------------------------------------------------------------------
    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # jinja's signature
        budget = _BUDGET.get()
        if budget is not None:
            budget.spend()
            # str's own methods, and those of str subclasses (Markup's are Python functions: MethodType)
            owner = getattr(__obj, "__self__", None)
            if isinstance(__obj, (types.BuiltinMethodType, types.MethodType)) and isinstance(owner, str):
                args = _check_str_method(budget, __obj, args, kwargs)
            elif owner is not None and args:
                _check_comparing_method(budget, owner, getattr(__obj, "__name__", ""), args)
        result = super().call(__context, __obj, *args, **kwargs)
        if budget is not None:
            if isinstance(result, list):
                budget.spend(len(result))
            budget.check_size(result)
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``str.format``/``format_map`` of a template string, with ``_BudgetedFormatter`` (Jinja's
        ``SandboxedEnvironment.wrap_str_format`` otherwise)."""
        budget = _BUDGET.get()
        if (
            budget is None
            or not isinstance(value, (types.MethodType, types.BuiltinMethodType))
            or value.__name__ not in ("format", "format_map")
            or not isinstance(getattr(value, "__self__", None), str)
        ):
            return super().wrap_str_format(value)
        if type(value.__self__) is not str:  # Markup: Jinja's escaping formatter, after the same size checks
            escaping = super().wrap_str_format(value)
            plain = getattr(str(value.__self__), value.__name__)
            check = self.wrap_str_format(plain)
            if escaping is None or check is None:
                return escaping

            def checked(*args: Any, **kwargs: Any) -> str:
                check(*args, **kwargs)
                return escaping(*args, **kwargs)

            return functools.update_wrapper(checked, value)
        fmt, is_format_map = value.__self__, value.__name__ == "format_map"  # a str: checked above
        formatter = _BudgetedFormatter(self, budget)

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                kwargs, args = args[0], ()
            return formatter.vformat(fmt, args, kwargs)

        return functools.update_wrapper(wrapper, value)

    def call_binop(self, context: jinja2.runtime.Context, op: str, left: Any, right: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.spend()
            limit = budget.max_chars
            if op == "*" and isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > _MAX_POW_BITS:
                    raise TemplateLimitError("chat template computed a number that is too large")
            elif op == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * max(n, 0) > limit:
                        raise TemplateLimitError(
                            f"chat template built a value of {len(seq) * n} items, over the limit of {limit}"
                        )
            elif op == "%":
                if isinstance(left, str):
                    check_printf(budget, left, right)
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

    def compare_guard(self, op: str, left: Any, right: Any) -> Any:
        """``left op right`` (Jinja's operator names: ``eq``, ``ne``, ``lt``, ``lteq``, ``gt``, ``gteq``, ``in``,
        ``notin``), charged ``compare_cost`` units before Python compares (``_GuardedCodeGenerator`` chains the
        pairs of ``a < b < c`` as Python does)."""
        budget = _BUDGET.get()
        if budget is not None and (cost := compare_cost(budget, op, left, right)):
            budget.spend(cost)
        return _COMPARE_OPS[op](left, right)

    def loop_guard(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Wraps every ``{% for %}`` iterable: one budget unit per iteration."""
        budget = _BUDGET.get()
        if budget is None:
            yield from iterable
            return
        for item in iterable:
            budget.spend()
            yield item

    def concat_guard(self, *parts: Any) -> str:
        """``a ~ b ~ c`` (Jinja's str_join), with the size cap (measured before the parts become strings)."""
        budget = _BUDGET.get()
        if budget is not None:
            budget.spend()
            total = 0
            for part in parts:
                total += budget.text_size(part)
                budget.check_planned(total, "concatenated string")
        result = "".join(map(str, parts))
        if budget is not None:
            budget.check_size(result)
        return result

    # -- parse-time rewrite -------------------------------------------------------------------
    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        tree = super()._parse(source, name, filename)
        tree = cast(jinja2.nodes.Template, _GuardInserter().visit(tree))  # the same root, its loops rewritten
        tree.set_environment(self)
        return tree


class _GuardInserter(jinja2.visitor.NodeTransformer):
    """Wraps ``{% for %}`` iterables in ``environment.loop_guard(...)`` and turns ``a ~ b`` into
    ``environment.concat_guard(a, b)``; the template cannot name ``environment``."""

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        node = cast(jinja2.nodes.For, self.generic_visit(node))  # the node itself, its children visited
        node.iter = jinja2.nodes.Call(
            jinja2.nodes.EnvironmentAttribute("loop_guard"), [node.iter], [], None, None, lineno=node.lineno
        )
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        node = cast(jinja2.nodes.Concat, self.generic_visit(node))  # the node itself, its children visited
        return jinja2.nodes.Call(
            jinja2.nodes.EnvironmentAttribute("concat_guard"), list(node.nodes), [], None, None, lineno=node.lineno
        )


_COMPARE_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "lteq": operator.le, "gt": operator.gt,
    "gteq": operator.ge, "in": lambda a, b: a in b, "notin": lambda a, b: a not in b,
}

#: Jinja's comparison tests (``jinja2.tests.TESTS``) as ``compare_cost``'s operator names
_TEST_OPS = {"in": "in", "==": "eq", "eq": "eq", "equalto": "eq", "!=": "ne", "ne": "ne", ">": "gt", "gt": "gt",
             "greaterthan": "gt", "ge": "gteq", ">=": "gteq", "<": "lt", "lt": "lt", "lessthan": "lt", "<=": "lteq",
             "le": "lteq"}


def _guard_test(op: str, test: Callable[..., Any]) -> Callable[..., Any]:
    """Jinja comparison test ``test(value, other)`` (``other`` given by position or by name) charged
    ``compare_cost(op)`` before it runs."""

    def guarded(value: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        others = [*args, *kwargs.values()]
        if budget is not None and len(others) == 1 and (cost := compare_cost(budget, op, value, others[0])):
            budget.spend(cost)
        return test(value, *args, **kwargs)

    return functools.update_wrapper(guarded, test)


def _literal(node: jinja2.nodes.Node) -> bool:
    """A constant, or a list/tuple literal of constants: its size is bounded by the template's own text."""
    if isinstance(node, jinja2.nodes.Const):
        return True
    return isinstance(node, (jinja2.nodes.List, jinja2.nodes.Tuple)) and all(
        isinstance(item, jinja2.nodes.Const) for item in node.items)


def _cheap_pair(op: str, left: jinja2.nodes.Node, right: jinja2.nodes.Node) -> bool:
    """A comparison whose C work is bounded by a literal of the template: for ``in``, a literal container (a
    literal needle is compared with every item of a container of any size); for ``==`` and the orderings, a literal
    on either side (the walk stops at the shorter side)."""
    if op in ("in", "notin"):
        return _literal(right)
    return _literal(left) or _literal(right)


def compare_cost(budget: RenderBudget, op: str, left: Any, right: Any) -> int:
    """Budget units for Python to compare ``left`` with ``right`` (``op`` as in ``compare_guard``), from the
    operands, before it runs: in one C call, ``b in [a] * 200000`` with ``a`` and ``b`` distinct 1 MB strings equal
    but for their last character compared 200 GB (5.2 s; DECISIONS D-298). One unit per container item compared
    plus one per 1,000 characters or items walked (``_compare_size``): ``x in seq`` compares ``x`` with each item;
    ``seq1 == seq2`` and the orderings go item by item as far as the shorter side; membership in a str is a linear
    search; in a dict, set or keys view, a hash of the needle (a tuple's hash is not cached: it walks the tuple).
    0 for what costs little whatever the values (numbers, short strings, a container against a scalar), so such
    comparisons spend nothing, as before. Raises ``TemplateLimitError`` (operation budget) when walking the
    operands alone would pass it."""
    if op == "in" or op == "notin":
        if isinstance(right, str):
            return len(right) // 1000
        if isinstance(right, _SCANNED):
            needle = _compare_size(budget, left)
            return len(right) + min(len(right) * needle, _compare_size(budget, right)) // 1000
        if isinstance(right, _HASHED):
            return 0 if isinstance(left, (int, float, type(None))) else _compare_size(budget, left) // 1000
        return 0
    if isinstance(left, _COMPARED_ITEMWISE) and isinstance(right, _COMPARED_ITEMWISE):
        return min(len(left), len(right)) + min(_compare_size(budget, left), _compare_size(budget, right)) // 1000
    if isinstance(left, str) and isinstance(right, str):
        return min(len(left), len(right)) // 1000
    return 0


#: containers whose membership test compares the needle with each item
_SCANNED = (list, tuple, ValuesView, collections.deque)
#: containers whose membership test hashes the needle (an items view also compares the value)
_HASHED = (Mapping, set, frozenset, KeysView, ItemsView)
#: containers that ``==`` and the orderings compare item by item
_COMPARED_ITEMWISE = (list, tuple, Mapping, set, frozenset, KeysView, ValuesView, ItemsView, collections.deque)


def _compare_size(budget: RenderBudget, value: Any) -> int:
    """Characters plus items that comparing or hashing ``value`` item by item can walk: strings their length,
    containers (lists, tuples, sets, dicts and their views, namespaces' attributes) their items and what they hold,
    each shared reference again; anything else 1. Raises ``TemplateLimitError`` once more items are walked than the
    budget has left."""
    total = walked = 0
    room = max(0, budget.max_ops - budget.ops)
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
            continue
        if isinstance(v, jinja2.utils.Namespace):
            v = object.__getattribute__(v, "_Namespace__attrs")
        if isinstance(v, _COMPARED_ITEMWISE):
            walked += len(v)
            total += len(v)
            if walked > room:
                budget.spend(walked)  # more to walk than the budget has left: raises
            if isinstance(v, (Mapping, ItemsView)):
                stack.extend(x for kv in (v.items() if isinstance(v, Mapping) else v) for x in kv)
            else:
                stack.extend(v)
        else:
            total += 1
    return total
