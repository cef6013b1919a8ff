"""Issue 39: every client grammar, regex and schema is checked in linear time, with explicit caps, before any library
sees it (``inference.shared.structured_caps``), and the engine compiles only the gateway's engine form.

The reproductions of the review: llguidance's format sniffing (``(?m)^\\s*...``) backtracks quadratically over blank
lines (9,000 of them: 1.7 s with the GIL held); our ``ref_cycle`` walked every ``$ref`` chain from every node (cubic:
a 17 KB chain froze the render route's thread pool); the library's GBNF converter is quadratic in its rules."""

from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llguidance.gbnf_to_lark import is_lark_syntax

from inference.shared import structured_caps as caps
from inference.shared.structured import check, engine_grammar
from inference.shared.structured_caps import StructuredSpecError


def cpu(fn, *args) -> float:
    t0 = time.process_time()
    try:
        fn(*args)
    except StructuredSpecError:
        pass
    return time.process_time() - t0


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def test_ref_cycle_resolves_each_ref_once(monkeypatch):
    """Linear, counted: a chain of n ``$ref`` s costs n pointer resolutions (the old walk: n² / 2, each with a
    linear search of the chain so far)."""
    calls = 0
    real = caps._pointer

    def counting(root, ref):
        nonlocal calls
        calls += 1
        return real(root, ref)

    monkeypatch.setattr(caps, "_pointer", counting)
    for n in (100, 400):
        calls = 0
        assert caps.ref_cycle(ref_chain(n)) is None
        assert calls <= n + 1
    looped = ref_chain(300)
    looped["$defs"]["d300"] = {"$ref": "#/$defs/d0"}
    calls = 0
    assert caps.ref_cycle(looped) == " -> ".join(["#/$defs/d0", *(f"#/$defs/d{i}" for i in range(1, 301)),
                                                   "#/$defs/d0"])
    assert calls <= 302


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(["\n", " ", "\t", "\r", "start", ":", "%llguidance", " x", "root ::=", "\n  "]),
                max_size=40).map("".join))
def test_lark_sniffing_agrees_with_llguidance(text):
    """The linear test gives llguidance's own answer on every text."""
    assert caps.is_lark(text) == is_lark_syntax(text)


@pytest.mark.parametrize("text", ["\n" * 60_000 + "x", "start" + "\n" * 60_000, "\nstart" * 10_000 + " " * 1000])
def test_lark_sniffing_is_linear_on_blank_lines(text):
    assert cpu(caps.is_lark, text) < 0.05  # llguidance's regex: ~25 s on 60,000 blank lines


@pytest.mark.parametrize(("kind", "spec", "words"), [
    ("grammar", 'root ::= "a"' + "\n" * 16_000, "lines"),
    ("grammar", "\n".join(f'r{i} ::= "a"' for i in range(600)), "rules"),
    ("grammar", "start: " + "(" * 70 + '"a"' + ")" * 70, "levels"),
    ("regex", "(" * 70 + "a" + ")" * 70, "levels"),
    ("json", json.dumps(ref_chain(600)), "$ref"),
    ("json", json.dumps({"$defs": {f"d{i}": {"type": "string"} for i in range(600)}, "type": "string"}), "$defs"),
    ("grammar", "x" * (caps.MAX_SPEC_BYTES + 1), "bytes"),
    # a JSON schema embedded in Lark (%json) meets the schema caps too (the review passed a 1,800-$ref chain and a
    # cycle through it)
    ("grammar", "start: %json " + json.dumps(ref_chain(600)), "$ref"),
    ("grammar", 'start: "x" item\nitem: %json {"$ref": "#"}', "refers to itself"),
])
def test_over_a_cap_is_refused_in_linear_time(kind, spec, words):
    with pytest.raises(StructuredSpecError, match=re.escape(words)):
        check(kind, spec)
    assert cpu(check, kind, spec) < 0.2


@pytest.mark.parametrize(("kind", "spec"), [
    ("grammar", 'root ::= object\nobject ::= "{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? "}"\n'
                'value ::= object | string | number\nstring ::= "\\"" [a-z]* "\\""\nnumber ::= [0-9]+\nws ::= [ ]?'),
    ("grammar", 'start: item+\nitem: "(" WORD ")"\nWORD: /[a-z]+/'),
    ("regex", r"(\d{3})-(\d{3})-(\d{4})"),
    ("json", json.dumps(ref_chain(200))),
])
def test_ordinary_constraints_pass_the_caps(kind, spec):
    assert check(kind, spec)


def test_the_engine_compiles_only_the_engine_form():
    """GBNF reaching an engine is not converted there (no Python-side grammar work on an engine thread): it is not
    Lark, so it fails to compile, as any invalid grammar does."""
    form = check("grammar", 'root ::= "a" | "b"')
    assert form.startswith("%llguidance {}") and "start:" in form
    assert engine_grammar("grammar", form)
    import llguidance

    ok, _messages = llguidance.LLMatcher.validate_grammar_with_warnings(engine_grammar("grammar", 'root ::= "a"'))
    assert ok  # is_error: the engine compiles GBNF as Lark and refuses it


def test_a_huge_schema_object_is_refused_without_serialising_it():
    """A 12 MB schema in a request body (49,000 properties) is refused by a walk that stops at the cap, not after
    ``json.dumps`` of the whole (which stalled the api ~100 ms a request): in-run ratio against serialising it."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer", "description": "x" * 200}
                                               for i in range(49_000)}}
    with pytest.raises(StructuredSpecError, match="more than"):
        caps.check_value_size(schema)
    walk = min(cpu(caps.check_value_size, schema) for _ in range(3))
    dump = min(cpu(json.dumps, schema) for _ in range(3))
    assert walk * 20 < dump, (walk, dump)
    caps.check_value_size({"type": "object", "properties": {"a": {"type": "string"}}})  # small ones pass


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.one_of(st.text(max_size=30), st.integers(), st.booleans(), st.none(), st.floats(allow_nan=False)),
                    lambda inner: st.one_of(st.lists(inner, max_size=5),
                                            st.dictionaries(st.text(max_size=10), inner, max_size=5)),
                    max_leaves=40))
def test_the_size_walk_never_refuses_what_fits(value):
    """The walk adds up a lower bound: it refuses only what ``json.dumps`` (as the gateway serialises) makes longer
    than the cap, checked against the real length with a cap set to it."""
    size = len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    saved = caps.MAX_SPEC_BYTES
    try:
        caps.MAX_SPEC_BYTES = size
        caps.check_value_size(value)  # exactly at the cap: passes
    finally:
        caps.MAX_SPEC_BYTES = saved
