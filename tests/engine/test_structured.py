"""Structured outputs in the engine (issue 16): the grammar cache, the per-step mask, and the real engine process
masking its sampling to a JSON schema, regex, choice list or grammar (demo model, random weights, real tokenizer,
real Redis)."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from inference.engine.structured import GrammarCompiler, GrammarMasker, SequenceGrammar
from inference.protocol.engine import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from inference.structured import StructuredSpecError

EOS_IDS = [151645, 151643]

PROMPT = [9707, 11, 1879, 0, 3555, 374, 279, 6722, 315, 9625, 30]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "ok": {"type": "boolean"},
    "color": {"enum": ["red", "green", "blue"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "ok", "color", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(model_dir):
    c = GrammarCompiler(model_dir, EOS_IDS, threads=2, cache_size=2)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def text_of(tok: Tokenizer, ids: list[int]) -> str:
    return tok.decode([t for t in ids if t not in EOS_IDS], skip_special_tokens=False)


# ----------------------------------------------------------------------------- grammar cache and mask (no engine)


def test_compile_cache_hits_by_spec_and_evicts_lru(compiler):
    a = compiler.compile("regex", "[0-9]{3}")
    assert compiler.compile("regex", "[0-9]{3}") is a  # the same compiled grammar
    a.result(timeout=60)
    b = compiler.compile("choice", '["x", "y"]')
    compiler.compile("regex", "[0-9]{3}")  # a used: b is the least recently used
    compiler.compile("json_object", "")
    assert compiler.compile("regex", "[0-9]{3}") is a
    assert compiler.compile("choice", '["x", "y"]') is not b  # evicted, compiled again
    assert compiler.key("regex", "a") != compiler.key("regex", "b") and len(compiler.key("regex", "a")) == 64


def test_bad_grammar_fails_its_future(compiler):
    fut = compiler.compile("grammar", "start: undefined_rule")
    with pytest.raises(StructuredSpecError):
        fut.result(timeout=60)


def _walk(compiler, masker, tok, kind, spec, width=151936, pick=0):
    """Drive one matcher with the mask alone (always the ``pick``-th allowed token), checking the mask each step."""
    g = SequenceGrammar(compiler.compile(kind, spec), [], frozenset(EOS_IDS))
    g.future.result(timeout=60)
    g.start()
    out: list[int] = []
    for _ in range(200):
        m = masker.mask([(0, g)], 1, width, torch.device("cpu"))
        allowed = (~m.disallowed[0]).nonzero().flatten().tolist()
        assert allowed and max(allowed) < compiler.tokenizer.vocab_size  # nothing past the tokenizer
        if g.complete:
            assert sorted(allowed) == sorted(EOS_IDS)  # a complete grammar allows only EOS
        t = allowed[pick % len(allowed)]
        if g.advance(t):
            return text_of(tok, out)
        out.append(t)
    raise AssertionError("no end")


def test_mask_walks_only_valid_outputs(compiler, tok):
    masker = GrammarMasker(compiler)
    assert _walk(compiler, masker, tok, "choice", '["yes", "no way"]') in ("yes", "no way")
    assert _walk(compiler, masker, tok, "choice", '["yes", "no way"]', pick=-1) in ("yes", "no way")
    assert re.fullmatch(r"[0-9]{3}-[a-c]{1,4}", _walk(compiler, masker, tok, "regex", "[0-9]{3}-[a-c]{1,4}", pick=5))
    for pick in (0, 7, -1):
        jsonschema.validate(json.loads(_walk(compiler, masker, tok, "json", json.dumps(SCHEMA), pick=pick)), SCHEMA)


def test_markup_tokens_that_are_text_walk_as_text(compiler, tok):
    """Qwen3's ``<think>`` / ``<tool_call>`` are added tokens that are not special: a grammar's text may be written
    with them (one token each, as a real model writes them), and the matcher accepts what the mask offered
    (llguidance alone marks them special, offered ``<think>`` for the text and then refused it)."""
    masker = GrammarMasker(compiler)
    for pick in (0, -1):
        assert _walk(compiler, masker, tok, "regex", "<think>\nab</think>", pick=pick) == "<think>\nab</think>"
        assert _walk(compiler, masker, tok, "regex", "x<tool_call>y", pick=pick) == "x<tool_call>y"
    special = compiler.tokenizer.is_special_token
    assert special(EOS_IDS[0]) and not special(tok.token_to_id("<think>"))


def test_after_token_ids_leave_the_start_unconstrained(compiler):
    masker = GrammarMasker(compiler)
    g = SequenceGrammar(compiler.compile("choice", '["x"]'), [151668], frozenset(EOS_IDS))
    g.future.result(timeout=60)
    g.start()
    assert masker.mask([(0, g)], 2, 151936, torch.device("cpu")) is None  # inactive: no mask
    g.advance(100)
    assert not g.constraining
    g.advance(151668)  # the start id: constrained from the next token
    m = masker.mask([(1, g)], 2, 151936, torch.device("cpu"))
    assert m is not None and m.row_list == [1] and not m.disallowed[0].any()  # row 0 is not constrained
    assert 1 <= (~m.disallowed[1]).sum().item() < 100


# ----------------------------------------------------------------------------- the engine process


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _final(outs):
    return [o for o in outs if o.finish_reason][0]


def test_engine_json_schema_outputs_all_validate(engine, tok):
    spec = json.dumps(SCHEMA)
    rids = [engine.send(PROMPT, temperature=1.0, seed=i, max_tokens=120, structured_kind="json",
                        structured_spec=spec) for i in range(8)]
    plain = engine.send(PROMPT, temperature=1.0, seed=1, max_tokens=30)  # an unconstrained companion
    got = engine.collect([*rids, plain])
    for rid in rids:
        fin = _final(got[rid])
        assert fin.finish_reason == FINISH_STOP, fin
        assert _tokens(got[rid])[-1] in EOS_IDS
        jsonschema.validate(json.loads(text_of(tok, _tokens(got[rid]))), SCHEMA)
    assert _final(got[plain]).finish_reason == FINISH_LENGTH and len(_tokens(got[plain])) == 30


def test_engine_regex_choice_grammar_and_length(engine, tok):
    rx = engine.send(PROMPT, temperature=1.0, max_tokens=40, structured_kind="regex",
                     structured_spec=r"[A-Z][a-z]{2,5} [0-9]{2}")
    ch = engine.send(PROMPT, temperature=1.0, max_tokens=40, structured_kind="choice",
                     structured_spec='["alpha", "beta gamma", "δ"]')
    gr = engine.send(PROMPT, temperature=1.0, max_tokens=40, structured_kind="grammar",
                     structured_spec='root ::= "(" ("x" | "y")+ ")"')
    short = engine.send(PROMPT, temperature=1.0, max_tokens=3, structured_kind="json",
                        structured_spec=json.dumps(SCHEMA))
    got = engine.collect([rx, ch, gr, short])
    assert re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", text_of(tok, _tokens(got[rx])))
    assert text_of(tok, _tokens(got[ch])) in ("alpha", "beta gamma", "δ")
    assert re.fullmatch(r"\([xy]+\)", text_of(tok, _tokens(got[gr]))) or _final(got[gr]).finish_reason == "length"
    assert _final(got[short]).finish_reason == FINISH_LENGTH and len(_tokens(got[short])) == 3
    assert text_of(tok, _tokens(got[short])).startswith("{")


def test_engine_survives_bad_constraints(engine):
    bad = [engine.send(PROMPT, max_tokens=5, structured_kind="grammar", structured_spec="start: nope"),
           engine.send(PROMPT, max_tokens=5, structured_kind="json", structured_spec="{not json"),
           engine.send(PROMPT, max_tokens=5, structured_kind="regex", structured_spec="[a-"),
           engine.send(PROMPT, max_tokens=5, structured_kind="nonsense", structured_spec="x")]
    got = engine.collect(bad)
    for rid in bad:
        assert _final(got[rid]).finish_reason == FINISH_ERROR and _final(got[rid]).error
    ok = engine.send(PROMPT, temperature=0, max_tokens=4)
    assert _final(engine.collect([ok])[ok]).finish_reason == FINISH_LENGTH


def test_engine_ignore_eos_and_min_tokens_yield_to_a_complete_grammar(engine, tok):
    rid = engine.send(PROMPT, temperature=1.0, max_tokens=30, min_tokens=20, ignore_eos=True,
                      structured_kind="choice", structured_spec='["done"]')
    outs = engine.collect([rid])[rid]
    assert _final(outs).finish_reason == FINISH_STOP and text_of(tok, _tokens(outs)) == "done"


def test_engine_constraint_after_start_token(engine, tok):
    start = 151668  # </think> in Qwen3's vocabulary
    rid = engine.send(PROMPT, temperature=1.0, max_tokens=20, logit_bias={start: 100.0},
                      structured_kind="choice", structured_spec='["yes", "no"]', structured_after_token_ids=[start])
    ids = _tokens(engine.collect([rid])[rid])
    assert ids[0] == start  # unconstrained: the bias picks it
    assert text_of(tok, ids[1:]) in ("yes", "no")


def test_engine_batch_keeps_decoding_while_a_grammar_compiles(engine):
    """A request waiting for its grammar holds no batch slot and stalls no step: a running request's tokens keep
    coming while many new schemas compile."""
    plain = engine.send(PROMPT, temperature=1.0, max_tokens=60, ignore_eos=True)
    first = engine.collect([plain], until_first_token=True)[plain]
    schemas = [json.dumps({**SCHEMA, "title": f"s{i}-{time.time()}"}) for i in range(6)]
    rids = [engine.send(PROMPT, temperature=1.0, max_tokens=120, structured_kind="json", structured_spec=s)
            for s in schemas]
    got = engine.collect([plain, *rids])
    assert len(_tokens(first + got[plain])) == 60
    assert all(_final(got[r]).finish_reason == FINISH_STOP for r in rids)
