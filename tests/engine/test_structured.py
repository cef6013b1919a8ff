"""Structured outputs in the engine (issue 16): the grammar cache, the per-step mask, and the real engine process
masking its sampling to a JSON schema, regex, choice list or grammar (demo model, random weights, real tokenizer,
real Redis)."""

from __future__ import annotations

import json
import random
import re
import time

import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from inference.engine.core import replica_stats
from inference.engine.runner import ModelRunner
from inference.engine.scheduler import Scheduler
from inference.engine.structured import GrammarCompiler, GrammarMasker, SequenceGrammar
from inference.protocol.engine import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineCoreRequest,
    SamplingParams,
)
from inference.shared.structured import StructuredSpecError

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
    # another cache scope (another tenant's cache salt) never gets this scope's compiled grammar: a hit's timing
    # would tell it which constraints the other sent
    assert compiler.compile("regex", "[0-9]{3}", scope="salt-of-b") is not a


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


def _reference_disallowed(compiler, rows, batch, width):
    """The mask as its definition says, one row at a time (llguidance's own single-matcher fill and numpy
    ``apply_token_bitmask_inplace``): True = masked."""
    vocab = compiler.tokenizer.vocab_size
    want = np.zeros((batch, width), dtype=np.bool_)
    for i, g in rows:
        bm = llguidance.numpy.allocate_token_bitmask(1, vocab)
        g.matcher.unsafe_compute_mask_ptr(bm.ctypes.data, bm.nbytes)
        logits = np.zeros((1, width), dtype=np.float32)
        llguidance.numpy.apply_token_bitmask_inplace(logits, bm)
        want[i] = np.isinf(logits[0])
        want[i, vocab:] = True
        eos = [t for t in g.eos_ids if t < width]
        if g.complete:
            want[i] = True
        if g.complete or g.accepting():
            want[i, eos] = False
    return want


@pytest.mark.parametrize("width", [151680, 151936, 151000])
def test_mask_matches_the_reference_on_mixed_batches(compiler, width):
    """The packed fast path (reused bitmask, EOS fix-ups on the words, inverted unpack) masks exactly what the
    row-by-row definition does: constrained rows in a run and scattered, complete and accepting grammars, logits
    wider and narrower than the tokenizer's vocabulary, and ``submit`` (the engine's ahead-of-forward path)."""
    masker = GrammarMasker(compiler)
    specs = [("json", json.dumps(SCHEMA)), ("choice", '["ab", "abc"]'), ("regex", "[0-9]{2,3}")]
    rng = random.Random(width)
    grammars = []
    # the request's EOS ids may differ from the tokenizer's (151645, 151643): one the tokenizer does not end on,
    # and one of the tokenizer's left out (llguidance allows it; a complete grammar allows only the request's)
    eos_sets = [frozenset([*EOS_IDS, 151670]), frozenset([151643, 151670])]
    for n, (kind, spec) in enumerate(specs * 2):
        g = SequenceGrammar(compiler.compile(kind, spec), [], eos_sets[n // len(specs)])
        g.future.result(timeout=60)
        g.start()
        grammars.append(g)
    seen = {"complete": 0, "accepting": 0}
    try:
        for step in range(40):
            live = [g for g in grammars if not g.complete]
            for layout in ("all", "run", "scattered"):
                n = len(grammars)
                if layout == "all":
                    rows = list(enumerate(grammars))
                    batch = n
                elif layout == "run":
                    rows = [(2 + j, g) for j, g in enumerate(grammars)]
                    batch = n + 3
                else:
                    rows = [(2 * j + 1, g) for j, g in enumerate(grammars)]
                    batch = 2 * n + 1
                got = masker.submit(rows, batch, width, torch.device("cpu")).result(timeout=60)
                assert got is not None and got.row_list == [i for i, _g in rows]
                want = _reference_disallowed(compiler, rows, batch, width)
                assert np.array_equal(got.disallowed.numpy(), want), (step, layout)
                logits = torch.zeros((batch, width))
                got.apply(logits)
                assert torch.equal(torch.isinf(logits), torch.from_numpy(want))
            seen["complete"] += sum(g.complete for g in grammars)
            seen["accepting"] += sum(g.accepting() and not g.complete for g in grammars)
            if not live:
                break
            m = masker.mask(list(enumerate(grammars)), len(grammars), width, torch.device("cpu"))
            assert m is not None
            for j, g in enumerate(grammars):
                if g.complete:
                    continue
                allowed = [t for t in (~m.disallowed[j]).nonzero().flatten().tolist() if t not in g.eos_ids]
                if allowed:
                    assert not g.advance(rng.choice(allowed))
    finally:
        masker.shutdown()
    assert seen["complete"] and seen["accepting"]  # both fix-ups were exercised


class _CheckedScheduler(Scheduler):
    """The engine's own scheduler, checking at each sampling that the mask computed while the forward ran is the
    mask of the matchers' state at that moment."""

    checked = 0

    def _apply(self, seqs, logits, ahead=None):
        if ahead is not None:
            early = ahead.result()
            now_ = self.masker.mask([(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None],
                                    logits.shape[0], logits.shape[1], logits.device)
            assert (early is None) == (now_ is None)
            if early is not None:
                assert early.row_list == now_.row_list
                assert torch.equal(early.disallowed, now_.disallowed)
                type(self).checked += 1
        super()._apply(seqs, logits, ahead)


def test_engine_step_masks_for_the_state_it_samples(model_dir, tok):
    """In-process engine steps (prefill and decode, constrained rows among unconstrained ones, a constraint that
    starts after a token): the mask built ahead, during the forward, is the one of the state sampled from, and
    every output is valid."""
    runner = ModelRunner(str(model_dir), max_model_len=512)
    core = _CheckedScheduler(runner, "e", replica_stats("e", "m", "cpu", 8), max_num_seqs=8)
    spec = json.dumps(SCHEMA)
    kinds = [dict(structured_kind="json", structured_spec=spec), {},
             dict(structured_kind="regex", structured_spec="[a-c]{2,4}!"),
             dict(structured_kind="json", structured_spec=spec), {},
             dict(structured_kind="choice", structured_spec='["yes", "no"]', structured_after_token_ids=[151668],
                  logit_bias={151668: 100.0})]
    outs = []
    for i, kw in enumerate(kinds):
        sp = SamplingParams(temperature=1.0, seed=i, max_tokens=100, eos_token_ids=EOS_IDS, **kw)
        accepted = core.accept([EngineCoreRequest(request_id=f"r{i}", external_req_id=f"r{i}", prompt_token_ids=PROMPT,
                                                  sampling_params=sp, client_id="c", arrival_time=time.time())])
        outs += [o for o in accepted["c"] if o.finish_reason]  # a refusal
    try:
        for _ in range(400):
            if not core.running and not core.waiting:
                break
            outs += [o for part in core.step() for o in part.get("c", []) if o.new_token_ids or o.finish_reason]
            if core.waiting and not core.running:
                core.wait_if_blocked()
    finally:
        core.shutdown()
    assert not core.running and not core.waiting
    ids = {f"r{i}": [t for o in outs if o.request_id == f"r{i}" for t in o.new_token_ids] for i in range(len(kinds))}
    fins = {o.request_id: o for o in outs if o.finish_reason}
    assert all(f.error is None for f in fins.values()), fins
    for rid in ("r0", "r3"):
        assert fins[rid].finish_reason == FINISH_STOP
        jsonschema.validate(json.loads(text_of(tok, ids[rid])), SCHEMA)
    assert re.fullmatch(r"[a-c]{2,4}!", text_of(tok, ids["r2"]))
    assert ids["r5"][0] == 151668 and text_of(tok, ids["r5"][1:]) in ("yes", "no")
    assert _CheckedScheduler.checked > 20


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
    gr = engine.send(PROMPT, temperature=1.0, max_tokens=40, structured_kind="grammar",  # the engine form: Lark
                     structured_spec='%llguidance {}\nstart: "(" ("x" | "y")+ ")"')
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
           # GBNF is the gateway's to convert (in its sandbox): the engine compiles only Lark, never converts
           engine.send(PROMPT, max_tokens=5, structured_kind="grammar", structured_spec='root ::= "a"'),
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
    if engine.backend == "vllm":  # per engine there, not per request: refused (the gateway answers 400 before this)
        fin = _final(engine.collect([rid])[rid])
        assert fin.finish_reason == FINISH_ERROR and "after the reasoning" in fin.error
        return
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
    got = engine.collect([plain, *rids], seen={plain: first})  # (the first collect may have read past its end)
    assert len(_tokens(got[plain])) == 60
    assert all(_final(got[r]).finish_reason == FINISH_STOP for r in rids)
