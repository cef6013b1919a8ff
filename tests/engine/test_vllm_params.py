"""The vLLM backend's mapping of our wire types to vLLM's fields (``inference.engine.vllm_backend.params``): plain
data, checked here without vLLM; the engine tests run the mapping against vLLM itself (``engine[vllm]``)."""

from __future__ import annotations

import math

import pytest

from inference.engine.vllm_backend.params import (
    UnsupportedRequestError,
    logprob_entries,
    prompt_logprob_entries,
    sampling_kwargs,
    stop_reason_of,
    structured_outputs_kwargs,
)
from inference.protocol.engine import SamplingParams

EOS = [151645, 151643]


def test_our_eos_ids_become_stop_ids_and_vllms_own_eos_is_off():
    kw = sampling_kwargs(SamplingParams(eos_token_ids=EOS, stop_token_ids=[7, 151645], max_tokens=5, min_tokens=2),
                         vocab_size=151680)
    assert kw["ignore_eos"] is True and kw["stop_token_ids"] == [7, 151645, 151643]
    assert (kw["max_tokens"], kw["min_tokens"], kw["n"], kw["detokenize"]) == (5, 2, 1, False)
    ignoring = sampling_kwargs(SamplingParams(eos_token_ids=EOS, stop_token_ids=[7], ignore_eos=True),
                               vocab_size=151680)
    assert ignoring["stop_token_ids"] == [7]
    # under a constraint a complete grammar's EOS ends the output whatever ignore_eos / min_tokens (the native rule)
    constrained = sampling_kwargs(SamplingParams(eos_token_ids=EOS, ignore_eos=True, min_tokens=9,
                                                 structured_kind="regex", structured_spec="a+"), vocab_size=151680)
    assert constrained["stop_token_ids"] == EOS and constrained["min_tokens"] == 0


def test_ids_past_the_tokenizer_get_minus_infinity_and_logit_bias_is_kept():
    kw = sampling_kwargs(SamplingParams(vocab_size=151669, logit_bias={5: 2.5}), vocab_size=151680)
    bias = kw["logit_bias"]
    assert bias[5] == 2.5 and len(bias) == 1 + 11
    assert all(math.isinf(bias[t]) and bias[t] < 0 for t in range(151669, 151680))
    assert sampling_kwargs(SamplingParams(), vocab_size=151680)["logit_bias"] is None


def test_sampling_fields_map_one_to_one():
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.1, seed=3, presence_penalty=0.5,
                        frequency_penalty=-0.5, repetition_penalty=1.2, logprobs=2, prompt_logprobs=1)
    kw = sampling_kwargs(sp, vocab_size=100)
    assert {k: kw[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                               "frequency_penalty", "repetition_penalty", "logprobs", "prompt_logprobs")} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.1, "seed": 3, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logprobs": 2, "prompt_logprobs": 1}


@pytest.mark.parametrize(("kind", "spec", "expected"), [
    ("json", '{"type": "object"}', {"json": {"type": "object"}}),
    ("json_object", "", {"json_object": True}),
    ("regex", "[a-z]+", {"regex": "[a-z]+"}),
    ("choice", '["a", "b c"]', {"choice": ["a", "b c"]}),
    ("grammar", '%llguidance {}\nstart: "x"', {"grammar": '%llguidance {}\nstart: "x"'}),
])
def test_structured_kinds_map_to_structured_outputs_params(kind, spec, expected):
    assert structured_outputs_kwargs(SamplingParams(structured_kind=kind, structured_spec=spec)) == expected
    assert sampling_kwargs(SamplingParams(structured_kind=kind, structured_spec=spec),
                           vocab_size=10)["structured_outputs"] == expected


@pytest.mark.parametrize("sp", [
    SamplingParams(structured_kind="json", structured_spec="{not json"),
    SamplingParams(structured_kind="choice", structured_spec='[1, 2]'),
    SamplingParams(structured_kind="nonsense", structured_spec="x"),
    SamplingParams(structured_kind="choice", structured_spec='["y"]', structured_after_token_ids=[151668]),
    # not the gateway's engine form: vLLM would sniff and convert it in Python on the replica's step loop
    SamplingParams(structured_kind="grammar", structured_spec='root ::= "x"'),
    SamplingParams(structured_kind="grammar", structured_spec="\n" * 9000 + "x"),
])
def test_constraints_vllm_cannot_take_are_refused(sp):
    with pytest.raises(UnsupportedRequestError):
        sampling_kwargs(sp, vocab_size=10)


def test_stop_reason_eos_reads_as_none_like_the_native_engine():
    sp = SamplingParams(eos_token_ids=EOS, stop_token_ids=[7, 151645])
    assert stop_reason_of(sp, 7) == 7
    assert stop_reason_of(sp, 151645) is None  # EOS is checked first
    assert stop_reason_of(sp, 151643) is None
    assert stop_reason_of(sp, "a stop string") is None and stop_reason_of(sp, None) is None
    assert stop_reason_of(SamplingParams(eos_token_ids=EOS, stop_token_ids=[151645], ignore_eos=True), 151645) == 151645


class Logprob:
    """vLLM's ``Logprob`` shape (``logprob``, ``rank``)."""

    def __init__(self, logprob: float):
        self.logprob = logprob


def test_logprob_entries_sort_the_top_k_and_keep_the_sampled_one():
    # sampled token 9 outside the top 2; vLLM's map holds it and the top 2
    pos = {9: Logprob(-5.0), 1: Logprob(-0.5), 2: Logprob(-1.0)}
    assert logprob_entries([9], [pos], 2) == [[-5.0, [[1, -0.5], [2, -1.0]]]]
    assert logprob_entries([1], [{1: Logprob(-0.5)}], 0) == [[-0.5, []]]
    assert logprob_entries([1], [pos], None) is None


def test_prompt_logprobs_start_with_none():
    got = prompt_logprob_entries([4, 5, 6], [None, {5: Logprob(-2.0), 8: Logprob(-1.0)}, {6: Logprob(-0.1)}], 1)
    assert got == [None, [-2.0, [[8, -1.0]]], [-0.1, [[6, -0.1]]]]
