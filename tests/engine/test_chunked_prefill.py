"""Chunked prefill and the slot KV cache, through the real scheduler (``Scheduler.step``) and the real model.

The scheduler runs in this process without a link (``step`` computes and returns its outputs), so the tests can look
at every step: which tokens came out, and how many positions the step computed.
"""

from __future__ import annotations

import random

import pytest

from inference.engine.runner import ModelRunner
from inference.engine.scheduler import Scheduler
from inference.protocol.engine import EngineCoreRequest, SamplingParams
from tests.engine.in_process import Outputs, merged, native_scheduler

BUDGET = 64
LONG = 700  # prompt tokens: 12 chunks at this budget with 4 decodes running
SHORT_TOKENS = 24


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(str(model_dir), max_model_len=1024, prefix_cache_mb=0)


def _core(runner: ModelRunner, chunked: bool = True) -> Scheduler:
    runner.reset()
    return native_scheduler(runner, max_num_seqs=8, max_num_batched_tokens=BUDGET, enable_chunked_prefill=chunked)


def _req(rid: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    return EngineCoreRequest(request_id=rid, external_req_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                             client_id="c", arrival_time=0.0)


def _outputs(outputs: Outputs) -> dict[str, list[tuple[int, float]]]:
    """(token, logprob) per request in ``outputs``."""
    got: dict[str, list[tuple[int, float]]] = {}
    for outs in outputs.values():
        for o in outs:
            for i, t in enumerate(o.new_token_ids):
                got.setdefault(o.request_id, []).append((t, o.new_logprobs[i][0]))
    return got


def _computed(core: Scheduler) -> dict[str, int]:
    return {s.request_id: s.num_computed for s in [*core.running, *core.prefilling, *core.waiting]}


def _prompts() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(7)
    shorts = [[rng.randrange(150000) for _ in range(12 + 3 * i)] for i in range(4)]
    return shorts, [rng.randrange(150000) for _ in range(LONG)]


def _run(core: Scheduler, join_at: int | None, shorts: list[list[int]], long: list[int] | None):
    """Step until every request finished. The short requests start at once; the long one joins after ``join_at``
    steps. Returns (tokens per request, [(positions computed, decodes that got a token)] per step)."""
    core.accept([_req(f"s{i}", p, SHORT_TOKENS) for i, p in enumerate(shorts)])
    tokens: dict[str, list[tuple[int, float]]] = {}
    steps = []
    n = 0
    while core.waiting or core.running or core.prefilling:
        if long is not None and n == join_at:
            core.accept([_req("long", long, 4)])
        before = _computed(core)
        running_before = {s.request_id for s in core.running}
        out = _outputs(merged(core.step()))
        after = _computed(core)
        finished = set(before) - set(after)
        work = sum(after.get(r, 0) - before.get(r, 0) for r in after) + len(finished & running_before)
        steps.append((work, running_before, set(out)))
        for rid, toks in out.items():
            tokens.setdefault(rid, []).extend(toks)
        n += 1
        assert n < 500
    return tokens, steps


def test_long_prompt_joining_running_decodes_gives_the_same_tokens_and_bounded_steps(runner):
    shorts, long = _prompts()
    alone_short, _ = _run(_core(runner), None, shorts, None)
    alone_long, _ = _run(_core(runner), 0, [], long)
    mixed, steps = _run(_core(runner), 3, shorts, long)

    for rid, want in {**alone_short, **alone_long}.items():
        got = mixed[rid]
        assert [t for t, _ in got] == [t for t, _ in want], rid
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-3), rid
    assert len(mixed["long"]) == 4 and all(len(mixed[f"s{i}"]) == SHORT_TOKENS for i in range(4))
    # every step computed at most the budget, and every running decode got its token in every step
    assert max(work for work, _r, _o in steps) <= BUDGET
    for _work, running, out in steps:
        assert running <= out
    # the long prompt really went in chunks while the short ones decoded
    long_steps = [w for w, r, _o in steps if len(r) == 4][3:]
    assert len(long_steps) >= LONG // BUDGET


def test_without_chunked_prefill_the_long_prompt_takes_one_step(runner):
    # the counter-check of the bound above: the same schedule without chunking computes the whole prompt at once
    shorts, long = _prompts()
    tokens, steps = _run(_core(runner, chunked=False), 3, shorts, long)
    assert max(work for work, _r, _o in steps) >= LONG
    assert len(tokens["long"]) == 4


def test_slots_are_reused_without_growing_the_cache(runner):
    core = _core(runner)
    rng = random.Random(3)
    for wave in range(2):
        core.accept([_req(f"w{wave}-{i}", [rng.randrange(150000) for _ in range(10 + i)], 2 + i % 3)
                     for i in range(8)])
        while core.num_held:
            merged(core.step())
            assert runner.kv.rows <= 8
        if wave == 0:
            size = runner.kv.nbytes
        assert runner.batch_size == 0 and runner.kv.nbytes == size
