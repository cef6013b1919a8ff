"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``, issue 16: completions ``echo`` + ``logprobs``): the
wire carries the parameter and the entries, the runner's chunked full-logits prefill gives every prompt position
the log-probability a plain transformers forward gives (also when the prompt's prefix is cached, which it must not
use), and the engine process sends them with the first token. The demo model, real Redis, a real engine."""

from __future__ import annotations

import random

import pytest
import torch

from inference.engine import runner as runner_mod
from inference.engine.runner import ModelRunner
from inference.engine.sequence import Sequence
from inference.protocol.engine import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SamplingParams,
                                       pack_requests, unpack_entry)

PROMPT = [785, 6722, 315, 9625, 374, 12095, 13, 576, 6722, 315, 9856, 374] * 3  # 36 ids, several blocks


def _request(rid: str, prompt: list[int], **sp) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, external_req_id=rid, prompt_token_ids=prompt,
                             sampling_params=SamplingParams(**sp), client_id="c", arrival_time=0.0)


def test_prompt_logprobs_cross_the_wire():
    req = _request("a", PROMPT, prompt_logprobs=3)
    assert EngineCoreRequest.from_wire(req.to_wire()).sampling_params.prompt_logprobs == 3
    children = [_request(f"a-{i}", PROMPT, prompt_logprobs=2, seed=i) for i in range(3)]
    for c in children:
        c.prompt_token_ids, c.external_req_id = PROMPT, "a"  # one request's n children: one group entry
    entries = pack_requests(children)
    assert len(entries) == 1 and list(entries[0]) == ["g"]
    back = unpack_entry({b"g": entries[0]["g"]})
    assert [r.sampling_params.prompt_logprobs for r in back] == [2, 2, 2]
    entry = [None, [-1.5, [[7, -0.5]]]]
    out = EngineCoreOutputs(engine_id="e", timestamp=0.0,
                            outputs=[EngineCoreOutput(request_id="a", new_token_ids=[1], prompt_logprobs=entry)])
    assert EngineCoreOutputs.from_wire(out.to_wire()).outputs[0].prompt_logprobs == entry


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(str(model_dir), max_model_len=512)


def _seq(runner: ModelRunner, prompt: list[int], **sp) -> Sequence:
    s = Sequence(request=_request("x", prompt, **sp), queued_ts=0.0, rng=random.Random(0))
    runner.prepare(s)
    return s


def test_runner_prompt_logprobs_equal_a_full_forward_even_with_a_cached_prefix(runner, monkeypatch):
    monkeypatch.setattr(runner_mod, "PROMPT_LOGPROBS_CHUNK", 7)  # several chunks, one ending mid-prompt
    runner.reset()
    plain = _seq(runner, PROMPT, temperature=0.0)
    (group,) = runner.prefill_groups([plain])
    plain_logits = runner.prefill(group)  # stores the prompt's full blocks in the prefix cache
    assert runner.prefix_cache is not None
    again = _seq(runner, PROMPT, temperature=0.0)
    runner.prefill_groups([again])
    assert again.num_cached_tokens > 0  # a plain request would reuse the prefix ...
    asking = _seq(runner, PROMPT, temperature=0.0, prompt_logprobs=2)
    groups = runner.prefill_groups([again, asking])
    assert groups[-1] == [asking] and asking.num_cached_tokens == 0  # ... one asking for prompt logprobs may not
    logits = runner.prefill([asking])
    assert torch.allclose(logits, plain_logits, atol=1e-4)  # the last position still gives the first token

    with torch.inference_mode():
        full = runner.model(input_ids=torch.tensor([PROMPT])).logits[0].float()
        full[:, runner.sample_vocab:] = float("-inf")  # the distribution ``sample`` reports logprobs from
        ref = torch.log_softmax(full, dim=-1)
    entries = asking.prompt_logprobs
    assert entries is not None and len(entries) == len(PROMPT) and entries[0] is None
    for i, (lp, top) in enumerate(entries[1:]):
        assert lp == pytest.approx(ref[i, PROMPT[i + 1]].item(), abs=1e-4)
        want_v, want_i = torch.topk(ref[i], 2)
        assert [t for t, _ in top] == want_i.tolist()
        assert [v for _, v in top] == pytest.approx(want_v.tolist(), abs=1e-4)
    # both rows decode on from the same state
    nxt = int(plain_logits.argmax())
    plain.output_token_ids.append(nxt)
    asking.output_token_ids.append(nxt)
    step = runner.decode([plain, asking])
    assert torch.allclose(step[0], step[1], atol=1e-4)
    runner.reset()


def test_engine_sends_prompt_logprobs_with_the_first_token(engine):
    # the logprob the engine reports for a generated token equals the prompt logprob of that token once it is
    # part of a prompt (two different paths: last-position sampling vs the chunked full-logits prefill)
    gen = engine.send(PROMPT, temperature=0.0, max_tokens=1, logprobs=0, ignore_eos=True)
    outs = engine.collect([gen])[gen]
    first = next(o for o in outs if o.new_token_ids)
    token, generated_lp = first.new_token_ids[0], first.new_logprobs[0][0]
    assert all(o.prompt_logprobs is None for o in outs)  # not asked: not sent

    rid = engine.send(PROMPT + [token], temperature=0.0, max_tokens=3, prompt_logprobs=1, ignore_eos=True)
    outs = engine.collect([rid])[rid]
    with_tokens = [o for o in outs if o.new_token_ids]
    entries = with_tokens[0].prompt_logprobs
    assert entries is not None and len(entries) == len(PROMPT) + 1 and entries[0] is None
    assert all(len(e[1]) == 1 for e in entries[1:])
    assert entries[-1][0] == pytest.approx(generated_lp, abs=1e-4)
    assert all(o.prompt_logprobs is None for o in outs if o is not with_tokens[0])  # sent once
    assert sum(len(o.new_token_ids) for o in outs) == 3
