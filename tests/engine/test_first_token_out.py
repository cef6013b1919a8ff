"""A newcomer's first token goes out before the running batch's decode forward (``Scheduler.step``).

A step prefills first, hands the first tokens out (its first part of outputs, which the core loop flushes before it
resumes the step), then decodes the sequences that were running when it began; the running sequences' tokens still go
out at the step's end. Without that order a request arriving while others decode waited one decode forward of all of
them for its first token (issue 19's 16-stream TTFT).
"""

from __future__ import annotations

import random
import time

import pytest

from inference.engine.runner import ModelRunner
from inference.protocol.engine import EngineCoreRequest, SamplingParams
from tests.engine.in_process import native_scheduler, tokens_of


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(str(model_dir), max_model_len=512, prefix_cache_mb=0)


def _req(rid: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id=rid, external_req_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                             client_id="c", arrival_time=0.0)


def test_step_hands_out_first_tokens_before_decoding_the_running_batch(runner):
    runner.reset()
    sched = native_scheduler(runner, max_num_seqs=8, max_num_batched_tokens=256)
    rng = random.Random(5)
    sched.accept([_req(f"run{i}", [rng.randrange(150000) for _ in range(20 + i)], 50) for i in range(3)])

    # nothing runs yet: the prefill's first tokens and the step's end are the same moment, one part
    assert [tokens_of(p) for p in sched.step()] == [{"run0": 1, "run1": 1, "run2": 1}]

    sched.accept([_req("new", [rng.randrange(150000) for _ in range(30)], 5)])
    steps = sched.step()
    # handed out first, holding the newcomer's first token and nothing of the running batch, not yet decoded
    assert tokens_of(next(steps)) == {"new": 1}
    assert [s.num_computed for s in sched.running if s.request_id != "new"] == [20, 21, 22]
    # then the running batch decoded, at the step's end; the newcomer decodes from the next step on
    assert [tokens_of(p) for p in steps] == [{"run0": 1, "run1": 1, "run2": 1}]
    assert [tokens_of(p) for p in sched.step()] == [{"run0": 1, "run1": 1, "run2": 1, "new": 1}]


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
