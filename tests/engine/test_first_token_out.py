"""A newcomer's first token goes out before the running batch's decode forward (``EngineCore.step``).

A step prefills first, hands the first tokens out (the loop's flush), then decodes the sequences that were running
when it began; the running sequences' tokens still go out at the step's end. Without that order a request arriving
while others decode waited one decode forward of all of them for its first token (issue 19's 16-stream TTFT).
"""

from __future__ import annotations

import random
import time

import pytest

from inference.engine.core import EngineCore
from inference.engine.runner import ModelRunner
from inference.protocol.engine import EngineCoreRequest, SamplingParams


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(str(model_dir), max_model_len=512, prefix_cache_mb=0)


def _req(rid: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id=rid, external_req_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                             client_id="c", arrival_time=0.0)


def _taken(core: EngineCore) -> dict[str, int]:
    """New tokens per request queued since the last call (and forget them)."""
    got: dict[str, int] = {}
    for outs in core._pending.values():
        for o in outs:
            if o.new_token_ids:
                got[o.request_id] = got.get(o.request_id, 0) + len(o.new_token_ids)
    core._pending = {}
    return got


def test_step_hands_out_first_tokens_before_decoding_the_running_batch(runner, redis_url):
    runner.reset()
    core = EngineCore("m", runner, redis_url, max_num_seqs=8, max_num_batched_tokens=256)
    rng = random.Random(5)
    calls: list[dict[str, int]] = []
    for i in range(3):
        core._accept_one(_req(f"run{i}", [rng.randrange(150000) for _ in range(20 + i)], 50))
    _taken(core)  # acceptance outputs

    # nothing runs yet: the prefill's first tokens and the step's end are the same moment, no hand-out between
    core.step(first_tokens_out=lambda: calls.append(_taken(core)))
    assert calls == [] and _taken(core) == {"run0": 1, "run1": 1, "run2": 1}

    core._accept_one(_req("new", [rng.randrange(150000) for _ in range(30)], 5))
    _taken(core)
    core.step(first_tokens_out=lambda: calls.append(_taken(core)))
    # handed out once, holding the newcomer's first token and nothing of the running batch, not yet decoded
    assert calls == [{"new": 1}]
    # then the running batch decoded, at the step's end; the newcomer decodes from the next step on
    assert _taken(core) == {"run0": 1, "run1": 1, "run2": 1}
    core.step(first_tokens_out=lambda: calls.append(_taken(core)))
    assert len(calls) == 1 and _taken(core) == {"run0": 1, "run1": 1, "run2": 1, "new": 1}


@pytest.mark.native_only("vLLM runs prefills and decodes in one forward")
def test_first_token_message_carries_no_token_of_the_running_request(engine):
    rng = random.Random(11)
    running = engine.send([rng.randrange(150000) for _ in range(12)], max_tokens=300, ignore_eos=True)
    engine.collect([running], until_first_token=True, timeout=120)
    newcomer = engine.send([rng.randrange(150000) for _ in range(12)], max_tokens=3, ignore_eos=True)
    deadline = time.time() + 120
    first = None
    while first is None and time.time() < deadline:
        for msg in engine.read():
            if any(o.request_id == newcomer and o.new_token_ids for o in msg.outputs):
                first = msg
                break
    assert first is not None, "the newcomer's first token never came"
    # its own message: the running request's token of that step follows in the next one
    assert [o for o in first.outputs if o.request_id == running and o.new_token_ids] == []
    engine.abort(running)
    engine.collect([running, newcomer], timeout=120)
