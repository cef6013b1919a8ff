"""Sampling at the edges of the parameters' ranges: whatever the penalties do to the logits, the sampled token is
inside the vocabulary and its logprob finite (schemathesis found ``repetition_penalty: 5e-324`` — 0 in float32 —
turning logits into inf, probabilities into NaN and the pick into an id past the tokenizer: a 500 in the
gateway). The demo model and the real runner."""

from __future__ import annotations

import math
import random

import pytest

from inference.engine.runner import ModelRunner
from inference.engine.sequence import Sequence
from inference.protocol.engine import EngineCoreRequest, SamplingParams

PROMPT = [785, 6722, 315, 9625, 374, 12095, 13]


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(str(model_dir), max_model_len=512)


def _seq(runner: ModelRunner, seed: int, **sp) -> Sequence:
    req = EngineCoreRequest(request_id=f"e{seed}", external_req_id="e", prompt_token_ids=PROMPT,
                            sampling_params=SamplingParams(**sp), client_id="c", arrival_time=0.0)
    s = Sequence(request=req, queued_ts=0.0, rng=random.Random(seed))
    runner.prepare(s)
    return s


@pytest.mark.parametrize("params", [
    {"repetition_penalty": 5e-324, "presence_penalty": -1.2259860974331438, "temperature": 1.0},
    {"repetition_penalty": 5e-324, "temperature": 0.0},
    {"repetition_penalty": 1e-30, "temperature": 2.0, "top_p": 0.5},
    {"repetition_penalty": 10.0, "frequency_penalty": 2.0, "presence_penalty": 2.0, "min_p": 1.0},
])
def test_edge_penalties_sample_inside_the_vocabulary(runner, params):
    vocab = 151669  # the Qwen3 tokenizer's size; the demo model's logits are wider (151680)
    seqs = [_seq(runner, seed, logprobs=1, vocab_size=vocab, **params) for seed in range(4)]
    logits = runner.prefill(seqs)
    for _ in range(3):
        tokens, entries = runner.sample(logits.clone(), seqs)
        assert all(0 <= t < vocab for t in tokens), tokens
        assert entries is not None and all(e is not None and math.isfinite(e[0]) for e in entries), entries
        for s, t in zip(seqs, tokens):
            s.output_token_ids.append(t)
