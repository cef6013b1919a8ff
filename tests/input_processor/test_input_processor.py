"""inference.api.input_processor: prompt lengths against max_model_len, sampling parameters merged over the model's
generation config, the ``n`` children (ids, seeds ``seed + i``), stop/EOS ids, and 400 errors naming the field
(docs/ARCHITECTURE.md §2 step 8; vLLM's ``vllm/v1/engine/input_processor.py``, ``get_max_tokens``; conformance C11, C16,
C17). Pure functions on real request models and the demo model's real config files; no I/O beyond reading those."""

from __future__ import annotations

import json
import re

import pytest

from inference.api.input_processor import (GenerationDefaults, check_prompt_tokens,
                                       generation_defaults, model_vocab_size, process_inputs, resolve_max_tokens)
from inference.protocol.openai import (ChatCompletionRequest, CompletionRequest, RequestValidationError,
                                       validate_request)
from harness.assets import MODEL_DIR

V = 1000
MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return validate_request(ChatCompletionRequest, {"model": "m", "messages": MSGS, **fields})


def completion(**fields) -> CompletionRequest:
    return validate_request(CompletionRequest, {"model": "m", "prompt": "hi", **fields})


NO_DEFAULTS = GenerationDefaults()


def run(req, prompt=(1, 2, 3), *, max_model_len=64, defaults=NO_DEFAULTS, **kw):
    return process_inputs(req, external_id="chatcmpl-x", prompt_token_ids=list(prompt), prompt_param="messages",
                          max_model_len=max_model_len, vocab_size=V, defaults=defaults, client_id="c1", **kw)


def raises(param: str, fn, *args, **kwargs) -> str:
    with pytest.raises(RequestValidationError) as exc:
        fn(*args, **kwargs)
    assert exc.value.param == param, (exc.value.param, str(exc.value))
    return str(exc.value)


# ------------------------------------------------------------------ prompt length and ids
def test_prompt_checks_name_the_prompt_field_and_the_numbers():
    assert "empty" in raises("messages", check_prompt_tokens, [], vocab_size=V, max_model_len=8,
                             prompt_param="messages")
    msg = raises("prompt", check_prompt_tokens, [1, V], vocab_size=V, max_model_len=8, prompt_param="prompt")
    assert str(V) in msg and str(V - 1) in msg
    raises("prompt", check_prompt_tokens, [-1], vocab_size=V, max_model_len=8, prompt_param="prompt")
    msg = raises("messages", check_prompt_tokens, [1] * 9, vocab_size=V, max_model_len=8, prompt_param="messages")
    assert "maximum context length is 8" in msg and "9 input tokens" in msg
    msg = raises("messages", check_prompt_tokens, [1] * 8, vocab_size=V, max_model_len=8, prompt_param="messages")
    assert "no room for at least one output token" in msg  # C17: filling it exactly is said as such
    check_prompt_tokens([0, V - 1] + [1] * 5, vocab_size=V, max_model_len=8, prompt_param="messages")  # 7 < 8


def test_max_tokens_resolution():
    r = dict(max_model_len=100, requested_param="max_tokens")
    assert resolve_max_tokens(prompt_len=30, requested=None, explicit=False, default_cap=None, **r) == 70
    assert resolve_max_tokens(prompt_len=30, requested=None, explicit=False, default_cap=20, **r) == 20
    assert resolve_max_tokens(prompt_len=30, requested=70, explicit=True, default_cap=None, **r) == 70
    assert resolve_max_tokens(prompt_len=99, requested=None, explicit=False, default_cap=None, **r) == 1
    # an endpoint default (completions: 16) that does not fit is clamped, never refused
    assert resolve_max_tokens(prompt_len=90, requested=16, explicit=False, default_cap=None, **r) == 10
    msg = raises("max_tokens", resolve_max_tokens, prompt_len=30, requested=71, explicit=True, default_cap=None, **r)
    # vLLM's wording, plus the allowed maximum (issue 16)
    assert msg == ("'max_tokens' is too large: 71. This model's maximum context length is 100 tokens and your "
                   "request has 30 input tokens (71 > 100 - 30): 'max_tokens' must be at most 70.")
    msg = raises("max_completion_tokens", resolve_max_tokens, prompt_len=1, requested=101, explicit=True,
                 default_cap=None, max_model_len=100, requested_param="max_completion_tokens")
    assert "'max_completion_tokens' is too large: 101" in msg and "'max_completion_tokens' must be at most 99" in msg


def test_process_inputs_lengths_per_endpoint():
    assert run(chat(), max_model_len=64).max_tokens == 61  # chat, omitted: the room left
    assert run(completion(), max_model_len=64).max_tokens == 16  # completions default 16
    assert run(completion(), max_model_len=10).max_tokens == 7  # the default clamped to the room
    assert run(chat(max_tokens=61), max_model_len=64).max_tokens == 61
    raises("max_tokens", run, chat(max_tokens=62), max_model_len=64)
    raises("max_tokens", run, completion(max_tokens=62), max_model_len=64)
    # completions honour max_completion_tokens as chat does (issue 16: it used to generate the default 16)
    assert run(completion(max_completion_tokens=40), max_model_len=64).max_tokens == 40
    assert run(completion(max_tokens=40, max_completion_tokens=40), max_model_len=64).max_tokens == 40
    assert run(completion(max_tokens=None, max_completion_tokens=3), max_model_len=64).max_tokens == 3
    assert "at most 61" in raises("max_completion_tokens", run, completion(max_completion_tokens=62),
                                  max_model_len=64)
    assert "differ" in raises("max_completion_tokens", completion, max_tokens=5, max_completion_tokens=6)
    raises("max_completion_tokens", run, chat(max_tokens=5, max_completion_tokens=62), max_model_len=64)
    assert run(chat(max_tokens=62, max_completion_tokens=5), max_model_len=64).max_tokens == 5  # it wins
    raises("messages", run, chat(), prompt=[1] * 64, max_model_len=64)
    assert run(chat(), defaults=GenerationDefaults(max_new_tokens=8)).max_tokens == 8


# ------------------------------------------------------------------ sampling parameters
def test_defaults_come_from_generation_config_then_openai(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
         "max_new_tokens": 32, "eos_token_id": [7, 8]}))
    d = generation_defaults(str(tmp_path))
    assert d == GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1,
                                   max_new_tokens=32, eos_token_ids=(7, 8))
    sp = run(chat(), defaults=d).requests[0].sampling_params
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (0.6, 0.95, 20, 0.05, 1.1)
    assert sp.eos_token_ids == [7, 8] and sp.max_tokens == 32
    sp = run(chat(temperature=0.9, top_p=0.5, top_k=3, min_p=0.1, repetition_penalty=1.3), defaults=d) \
        .requests[0].sampling_params  # the request wins
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (0.9, 0.5, 3, 0.1, 1.3)
    sp = run(chat()).requests[0].sampling_params  # no config: OpenAI defaults
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)
    assert sp.presence_penalty == sp.frequency_penalty == 0.0 and sp.seed is None and not sp.ignore_eos
    # do_sample false: the temperature default does not apply; a single EOS id becomes a one-element list
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6,
                                                                  "eos_token_id": 9}))
    d = generation_defaults(str(tmp_path))
    assert d.temperature is None and d.eos_token_ids == (9,)
    assert generation_defaults(str(tmp_path / "missing")) == GenerationDefaults()


def test_demo_model_config_files():
    d = generation_defaults(str(MODEL_DIR))
    assert set(d.eos_token_ids) <= {151645, 151643}
    assert model_vocab_size(str(MODEL_DIR)) == json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
    assert model_vocab_size(str(MODEL_DIR / "missing")) is None


def test_greedy_disables_the_other_samplers():
    sp = run(chat(temperature=0, top_p=0.5, top_k=5, min_p=0.2)).requests[0].sampling_params
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (0.0, 1.0, 0, 0.0)
    assert run(chat(top_k=-1)).requests[0].sampling_params.top_k == 0  # -1 = disabled (vLLM)


def test_eos_from_the_tokenizer_when_the_config_names_none():
    sp = run(chat(), eos_token_ids=[5]).requests[0].sampling_params
    assert sp.eos_token_ids == [5]
    sp = run(chat(), defaults=GenerationDefaults(eos_token_ids=(7,)), eos_token_ids=[5]).requests[0].sampling_params
    assert sp.eos_token_ids == [7]  # the model's generation config wins


def test_stop_ids_logit_bias_min_tokens_and_logprobs():
    sp = run(chat(stop_token_ids=[3, V - 1], logit_bias={"5": 2.5}, min_tokens=2, ignore_eos=True),
             logprobs=4).requests[0].sampling_params
    assert sp.stop_token_ids == [3, V - 1] and sp.logit_bias == {5: 2.5} and sp.min_tokens == 2
    assert sp.ignore_eos and sp.logprobs == 4 and sp.vocab_size == V
    assert str(V) in raises("stop_token_ids", run, chat(stop_token_ids=[V]))
    assert str(V) in raises("logit_bias", run, chat(logit_bias={str(V): 1}))
    assert str(V) in raises("top_k", run, chat(top_k=V + 1))
    msg = raises("min_tokens", run, chat(max_tokens=3, min_tokens=4))
    assert "min_tokens (4)" in msg and "max_tokens (3)" in msg
    # logprobs bounds are the request models' (OpenAI: top_logprobs 0..20; completions logprobs 0..5)
    for bad in ({"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": -1}):
        with pytest.raises(RequestValidationError) as exc:
            chat(**bad)
        assert exc.value.param == "top_logprobs"
    with pytest.raises(RequestValidationError) as exc:
        chat(top_logprobs=2)  # without logprobs
    assert exc.value.param == "top_logprobs"
    with pytest.raises(RequestValidationError) as exc:
        completion(logprobs=6)
    assert exc.value.param == "logprobs"
    assert chat(logprobs=True, top_logprobs=20).top_logprobs == 20 and completion(logprobs=5).logprobs == 5


# ------------------------------------------------------------------ n children
def test_n_children_ids_seeds_and_shared_fields():
    out = run(chat(n=3, seed=100, max_tokens=4), cache_salt="salt", arrival_time=123.0)
    assert [r.sampling_params.seed for r in out.requests] == [100, 101, 102]
    ids = [r.request_id for r in out.requests]
    assert len(set(ids)) == 3
    assert all(re.fullmatch(rf"chatcmpl-x-[0-9a-f]{{8}}-{i}", rid) for i, rid in enumerate(ids)), ids
    for r in out.requests:
        assert r.external_req_id == "chatcmpl-x" and r.prompt_token_ids == [1, 2, 3] and r.client_id == "c1"
        assert r.arrival_time == 123.0 and r.cache_salt == "salt" and r.sampling_params.max_tokens == 4
    assert out.requests[0].sampling_params is not out.requests[1].sampling_params  # children do not share
    (one,) = run(chat(seed=7)).requests
    assert re.fullmatch(r"chatcmpl-x-[0-9a-f]{8}", one.request_id) and one.sampling_params.seed == 7
    assert [r.sampling_params.seed for r in run(chat(n=2)).requests] == [None, None]
    assert [r.sampling_params.seed for r in run(chat(n=2, seed=-1)).requests] == [None, None]  # -1 = random
    assert run(chat(n=2)).requests[0].request_id != run(chat(n=2)).requests[0].request_id
