"""Issue 14, chat-template sandbox budgets: nothing is built before its size is checked (not at compile time,
not inside a filter or a string method), and iterable filters pay per element.

Each bomb is rendered through ``render_chat`` (the real tokenizer, the real sandbox) and must fail with
``TemplateLimitError`` (HTTP 400 ``template_limit``) while Python's traced peak allocation stays under 10 MB
(before the fix each of them built 100 MB or more, or was built while compiling)."""

from __future__ import annotations

import tracemalloc

import pytest

from inference.renderer.chat_template import compile_template, render_chat
from inference.renderer.errors import TemplateLimitError
from inference.renderer.sandbox import RenderBudget, activate_budget, deactivate_budget
from tests.renderer.tokdirs import tok_dir

BASIC = [{"role": "user", "content": "hi"}]
PEAK_LIMIT = 10 * 1024 * 1024

BOMBS = {
    "center_const": '{{ ""|center(100000000) }}',
    "tojson_indent": "{{ messages|tojson(indent=100000000) }}",
    "tojson_indent_const": "{{ [1, [2]]|tojson(indent=100000000) }}",
    "printf_width_filter": '{{ "%100000000s"|format("a") }}',
    "printf_width_op": '{{ "%100000000s" % "a" }}',
    "printf_precision": '{{ "%.100000000f" % 1.5 }}',
    "printf_star_width": '{{ "%*s" % (100000000, "a") }}',
    "str_format_width": '{{ "{:>100000000}".format("a") }}',
    "str_format_map_width": '{{ "{x:>100000000}".format_map({"x": "a"}) }}',
    "str_mul": '{{ "a" * 100000000 }}',
    "indent": '{{ "x"|indent(100000000) }}',
    "indent_str": '{{ "x\ny"|indent(" " * 900000) }}',
    "wordwrap_wrapstring": '{{ ("a " * 1000)|wordwrap(1, wrapstring="x" * 100000) }}',
    "ljust_method": '{{ "a".ljust(100000000) }}',
    "rjust_method": '{{ "a".rjust(100000000) }}',
    "center_method": '{{ "a".center(100000000) }}',
    "zfill_method": '{{ "1".zfill(100000000) }}',
    "expandtabs_method": '{{ ("\t" * 1000).expandtabs(100000) }}',
    "replace_filter": '{{ ("a" * 1000)|replace("a", "b" * 100000) }}',
    "replace_method": '{{ ("a" * 1000).replace("a", "b" * 100000) }}',
    "join_shared_refs": '{% set s = "x" * 1000000 %}{{ ([s] * 1000)|join }}',
    "join_method_shared_refs": '{% set s = "x" * 1000000 %}{{ "".join([s] * 1000) }}',
    "print_shared_refs": '{% set s = "x" * 1000000 %}{{ [s] * 1000 }}',
    "concat_shared_refs": '{% set s = "x" * 1000000 %}{{ "a" ~ ([s] * 1000) }}',
    "string_filter_shared_refs": '{% set s = "x" * 1000000 %}{{ ([s] * 1000)|string|length }}',
    "printf_shared_refs": '{% set s = "x" * 1000000 %}{{ "%s" % ([s] * 1000,) }}',
    "format_shared_refs": '{% set s = "x" * 1000000 %}{{ "{}".format([s] * 1000) }}',
    "batch_fill": '{{ [1]|batch(100000000, 0)|list|length }}',
    "translate_method": '{{ ("a" * 1000).translate({97: "b" * 100000}) }}',
    "lipsum": "{{ lipsum(1, min=10000000, max=10000001) }}",
}


@pytest.fixture(scope="module")
def qwen3():
    path = tok_dir("qwen3")
    render_chat(path, BASIC)  # tokenizer loaded outside the measured part
    return path


@pytest.mark.parametrize("template", list(BOMBS.values()), ids=list(BOMBS))
def test_bomb_is_refused_before_it_is_built(qwen3, template):
    tracemalloc.start()
    try:
        with pytest.raises(TemplateLimitError) as exc:
            render_chat(qwen3, BASIC, chat_template=template)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert exc.value.param == "chat_template"
    assert peak < PEAK_LIMIT, f"peak {peak} bytes"


def test_compiling_does_not_run_filters():
    """Jinja's constant folding ran ``center`` while compiling (outside any budget); now compiling builds
    nothing, and the template is refused when rendered."""
    tracemalloc.start()
    try:
        compile_template('{{ ""|center(50000000) }}{{ "x"|indent(50000000) }}')
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_LIMIT, f"compiling peaked at {peak} bytes"


def _ops(template: str, **variables) -> int:
    budget = RenderBudget(max_ops=10**9, max_chars=10**7)
    token = activate_budget(budget)
    try:
        compile_template(template).render(**variables)
    finally:
        deactivate_budget(token)
    return budget.ops


@pytest.mark.parametrize("expr", ["xs|sort|length", "xs|join(',')|length", "xs|unique|list|length",
                                  "xs|map('string')|list|length", "xs|select('odd')|list|length",
                                  "xs|sum", "xs|max", "xs|reverse|list|length", "xs|list|length",
                                  "xs|batch(3)|list|length", "xs|tojson|length", "d|dictsort|length",
                                  "d.items()|list|length"])
def test_iterable_filters_pay_per_element(expr):
    """A 100,000-element sort (join, unique, ...) costs at least 100,000 units, not one."""
    n = 100_000
    assert _ops("{{ " + expr + " }}", xs=list(range(n)), d={str(i): i for i in range(n)}) >= n


def test_per_element_charge_hits_the_budget(qwen3):
    """So the default budget refuses a template sorting the same long list again and again."""
    template = "{% set xs = range(100000)|list %}{% for i in range(30) %}{{ xs|sort|length }}{% endfor %}"
    with pytest.raises(TemplateLimitError):
        render_chat(qwen3, BASIC, chat_template=template)


@pytest.mark.parametrize("template,expected", [
    ('{{ "%5s|%-4d|%.2f" % ("a", 7, 1.5) }}', "    a|7   |1.50"),
    ('{{ "%(a)s-%(b)s"|format(a=1, b=2) }}', "1-2"),
    ('{{ "{:>5}|{:.3f}|{x!r}".format("a", 2.0, x="q") }}', "    a|2.000|'q'"),
    ('{{ "ab".center(6, "*") ~ "x".zfill(3) ~ "a\tb".expandtabs(4) }}', "**ab**00xa   b"),
    ('{{ ["a", "b"]|join(", ") ~ "-".join(["c", "d"]) }}', "a, bc-d"),
    ('{{ [{"n": "a"}, {"n": "b"}]|join("+", attribute="n") }}', "a+b"),
    ('{{ "a b c"|wordwrap(3) }}', "a b\nc"),
    ('{{ "x\ny"|indent(2, true) }}', "  x\n  y"),
    ('{{ {"a": [1, 2]}|tojson(indent=2) }}', '{\n  "a": [\n    1,\n    2\n  ]\n}'),
    ('{{ [3, 1, 2]|sort|list }}|{{ [1]|batch(3, 0)|list }}', "[1, 2, 3]|[[1, 0, 0]]"),
])
def test_ordinary_uses_render_as_before(qwen3, template, expected):
    assert render_chat(qwen3, BASIC, chat_template=template).prompt_text == expected
