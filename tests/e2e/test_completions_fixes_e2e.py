"""Issue 16, "fixes found on the way", against the live platform with the official ``openai`` client:
``/v1/completions`` honours ``max_completion_tokens``; ``echo`` with ``logprobs`` covers the echoed prompt (first
token ``null``, the rest the model's real log-probabilities, checked against a transformers forward of the demo
model in this process); an out-of-range ``max_tokens`` 400 states the allowed maximum."""

from __future__ import annotations

import math

import openai
import pytest
import torch

from inference.renderer.tokenizer_cache import get_tokenizer
from harness.assets import MODEL_DIR, TOKENIZER_DIR

MAX_MODEL_LEN = 512  # the live platform's registration
PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference():
    """``ids -> [len(ids), vocab]`` log-probabilities from a plain transformers forward of the demo model, over
    the ids the served tokenizer can decode (the engine reports logprobs over those)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    vocab = get_tokenizer(str(TOKENIZER_DIR)).vocab_size

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :, :vocab].float()
            return torch.log_softmax(logits, dim=-1)

    return logprobs


def _bad_request(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as exc:
        call()
    return exc.value


# ------------------------------------------------------------------ max_completion_tokens on completions
def test_completions_honour_max_completion_tokens(client, model_name):
    resp = client.completions.create(model=model_name, prompt=PROMPT, temperature=0,
                                     extra_body={"max_completion_tokens": 24, "ignore_eos": True})
    assert resp.usage.completion_tokens == 24 and resp.choices[0].finish_reason == "length"  # not the default 16
    same = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=5,
                                     extra_body={"max_completion_tokens": 5, "ignore_eos": True})
    assert same.usage.completion_tokens == 5
    err = _bad_request(lambda: client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=5, extra_body={"max_completion_tokens": 6}))
    assert err.status_code == 400 and err.body["param"] == "max_completion_tokens"
    assert "max_tokens (5)" in err.body["message"] and "max_completion_tokens (6)" in err.body["message"]


# ------------------------------------------------------------------ out-of-range max_tokens states the maximum
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_out_of_range_max_tokens_states_the_allowed_maximum(client, model_name, field):
    room = 3  # a prompt that leaves 3 tokens: the boundary is checked without generating hundreds
    prompt_ids = [9707] * (MAX_MODEL_LEN - room)
    err = _bad_request(lambda: client.completions.create(
        model=model_name, prompt=prompt_ids, extra_body={field: room + 1}))
    assert err.body["param"] == field
    assert f"'{field}' must be at most {room}" in err.body["message"], err.body["message"]
    assert f"{MAX_MODEL_LEN} - {MAX_MODEL_LEN - room}" in err.body["message"]
    assert client.completions.create(model=model_name, prompt=prompt_ids,
                                     extra_body={field: room, "ignore_eos": True}).usage.completion_tokens == room

    msgs = [{"role": "user", "content": "Hello there"}]
    prompt_tokens = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=1).usage.prompt_tokens
    err = _bad_request(lambda: client.chat.completions.create(
        model=model_name, messages=msgs, extra_body={field: MAX_MODEL_LEN - prompt_tokens + 1}))
    assert err.body["param"] == field
    assert f"'{field}' must be at most {MAX_MODEL_LEN - prompt_tokens}" in err.body["message"], err.body["message"]


# ------------------------------------------------------------------ echo + logprobs covers the prompt
def _check_echo_logprobs(lp, prompt_ids: list[int], reference, generated: int, k: int) -> None:
    p = len(prompt_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == p + generated
    tok = get_tokenizer(str(TOKENIZER_DIR))
    assert lp.tokens[:p] == [tok.decode([t], skip_special_tokens=False) for t in prompt_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    ref = reference(prompt_ids)
    for i in range(1, p):
        want = ref[i - 1, prompt_ids[i]].item()
        assert lp.token_logprobs[i] == pytest.approx(want, abs=1e-3), i
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and len(top) <= k + 1
        best = int(ref[i - 1].argmax())
        assert top[tok.decode([best], skip_special_tokens=False)] == pytest.approx(ref[i - 1, best].item(), abs=1e-3)
    assert all(x is not None and math.isfinite(x) for x in lp.token_logprobs[1:])
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets  # running on over the prompt and the completion


def test_echo_logprobs_cover_the_prompt(client, model_name, reference):
    resp = client.completions.create(model=model_name, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4,
                                     temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    prompt_ids = resp.model_extra["prompt_token_ids"]
    choice = resp.choices[0]
    assert choice.text.startswith(PROMPT)
    _check_echo_logprobs(choice.logprobs, prompt_ids, reference, 4, 2)
    # the completion part: greedy, so its first token is the reference's argmax after the prompt, same logprob
    out_ids = choice.model_extra["token_ids"]
    ref = reference(prompt_ids + out_ids)
    assert out_ids[0] == int(ref[len(prompt_ids) - 1].argmax())
    for j, t in enumerate(out_ids):
        assert choice.logprobs.token_logprobs[len(prompt_ids) + j] == pytest.approx(
            ref[len(prompt_ids) - 1 + j, t].item(), abs=1e-3)


def test_echo_logprobs_streamed_equal_non_streamed_and_n_choices_each_cover_it(client, model_name, reference):
    kw = dict(model=model_name, prompt=PROMPT, echo=True, logprobs=1, max_tokens=6, temperature=0.8, seed=7, n=2,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    full = client.completions.create(**kw)
    prompt_ids = full.model_extra["prompt_token_ids"]
    for c in full.choices:
        _check_echo_logprobs(c.logprobs, prompt_ids, reference, 6, 1)
    kw["extra_body"] = {"ignore_eos": True}
    chunks = list(client.completions.create(stream=True, **kw))
    for c in full.choices:
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == c.index]
        assert mine[0].text.startswith(PROMPT)  # the echo chunk
        assert "".join(m.text for m in mine) == c.text
        got = {f: [x for m in mine if m.logprobs for x in getattr(m.logprobs, f)]
               for f in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        assert got["tokens"] == c.logprobs.tokens and got["text_offset"] == c.logprobs.text_offset
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        assert got["token_logprobs"][1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-4)
