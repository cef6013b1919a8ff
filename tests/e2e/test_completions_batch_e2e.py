"""A batch of prompts in one ``/v1/completions`` request (OpenAI's ``prompt`` as a list of strings or of token-id
lists; vLLM serves it too), against the live platform with the official ``openai`` client: choice ``i × n + j``
is the ``j``-th completion of prompt ``i``, each choice equal to its prompt sent alone (greedy), streamed and not;
``echo`` and ``logprobs`` per prompt; usage sums the prompts once each and every choice's tokens, in the response
and in the usage record; ``/v1/completions/render`` gives one tokens-in request per prompt; a bad prompt anywhere
in the batch is a 400 that holds nothing."""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest

from inference.api.admission import model_snapshot
from inference.protocol.openai import MAX_COMPLETION_PROMPTS
from tests.e2e.test_usage_e2e import records

PROMPTS = ["The capital of France is", "One, two, three,", "Once upon a time there was a"]
GREEDY = dict(temperature=0, max_tokens=5, extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def alone(client, model_name):
    """Each prompt of ``PROMPTS`` sent on its own: ``(text, prompt_token_ids, token_ids)``."""
    out = []
    for p in PROMPTS:
        c = client.completions.create(model=model_name, prompt=p, **GREEDY)
        out.append((c.choices[0].text, c.model_extra["prompt_token_ids"], c.choices[0].model_extra["token_ids"]))
    return out


def _no_admission_held(live, model_name: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while model_snapshot(live.redis, live.prefix, model_name)["queued_reqs"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert model_snapshot(live.redis, live.prefix, model_name)["queued_reqs"] == 0


def test_a_batch_of_text_prompts_gives_n_choices_per_prompt_in_prompt_order(live, client, model_name, alone):
    tag = uuid.uuid4().hex[:8]
    # n > 1 refuses temperature 0 (vLLM's rule); top_k 1 is greedy too
    resp = client.completions.create(model=model_name, prompt=PROMPTS, n=2, temperature=1.0, max_tokens=5,
                                     extra_body={"ignore_eos": True, "return_token_ids": True, "top_k": 1},
                                     extra_headers={"X-Request-Id": f"batch-{tag}"})
    assert [c.index for c in resp.choices] == list(range(2 * len(PROMPTS)))
    for c in resp.choices:
        text, prompt_ids, out_ids = alone[c.index // 2]
        assert (c.text, c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]) == (text, prompt_ids, out_ids)
        assert c.finish_reason == "length"
    assert "prompt_token_ids" not in resp.model_extra  # per choice in a batch (vLLM's shape)
    prompt_tokens = sum(len(a[1]) for a in alone)
    assert resp.usage.prompt_tokens == prompt_tokens  # each prompt once, not once per choice
    assert resp.usage.completion_tokens == 2 * len(PROMPTS) * 5
    (row,) = records(live, f"cmpl-batch-{tag}", 1)
    assert (row["status_code"], row["prompt_tokens"], row["completion_tokens"]) == (200, prompt_tokens, 30)
    _no_admission_held(live, model_name)


def test_a_streamed_batch_equals_the_non_streamed_one(client, model_name, alone):
    chunks = list(client.completions.create(model=model_name, prompt=PROMPTS, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for ch in chunks[:-1]:
        (c,) = ch.choices
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    assert texts == {i: a[0] for i, a in enumerate(alone)}
    assert finish == {i: "length" for i in range(len(PROMPTS))}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == sum(len(a[1]) for a in alone)
    assert usage.completion_tokens == 5 * len(PROMPTS)


def test_token_id_prompts_and_echo_with_logprobs_cover_each_choices_own_prompt(client, model_name, alone):
    ids = [a[1] for a in alone]
    resp = client.completions.create(model=model_name, prompt=ids, echo=True, logprobs=1, **GREEDY)
    assert len(resp.choices) == len(ids)
    for c, (text, prompt_ids, out_ids) in zip(resp.choices, alone):
        assert c.model_extra["prompt_token_ids"] == prompt_ids and c.model_extra["token_ids"] == out_ids
        assert c.text.endswith(text) and len(c.text) > len(text)  # the decoded prompt, then the completion
        assert len(c.logprobs.tokens) == len(prompt_ids) + len(out_ids)
        assert c.logprobs.token_logprobs[0] is None and None not in c.logprobs.token_logprobs[1:]
    streamed = list(client.completions.create(model=model_name, prompt=ids, echo=True, logprobs=1, stream=True,
                                              temperature=0, max_tokens=5, extra_body={"ignore_eos": True}))
    for c in resp.choices:
        mine = [ch.choices[0] for ch in streamed if ch.choices and ch.choices[0].index == c.index]
        assert "".join(m.text for m in mine) == c.text
        assert [t for m in mine if m.logprobs for t in m.logprobs.tokens] == c.logprobs.tokens


def test_render_gives_one_tokens_in_request_per_prompt(live, model_name, alone):
    resp = httpx.post(live.base_url + "/v1/completions/render", timeout=60,
                      headers={"Authorization": f"Bearer {live.api_key}", "X-Request-Id": "r1"},
                      json={"model": model_name, "prompt": PROMPTS, "max_tokens": 3})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert [r["token_ids"] for r in body] == [a[1] for a in alone]
    assert [r["request_id"] for r in body] == [f"cmpl-r1-{i}" for i in range(len(PROMPTS))]
    assert all(r["sampling_params"]["max_tokens"] == 3 for r in body)


def test_a_bad_batch_is_a_400_naming_the_field_and_holds_nothing(live, client, model_name):
    def bad(**kw) -> dict:
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=model_name, max_tokens=2, **kw)
        return exc.value.body

    assert bad(prompt=["x"] * (MAX_COMPLETION_PROMPTS + 1))["param"] == "prompt"
    assert bad(prompt=["x"] * 16, n=MAX_COMPLETION_PROMPTS // 16 + 1)["param"] == "n"
    assert "prompt 1" in bad(prompt=[[5, 6], []])["message"]
    too_long = bad(prompt=["short", "word " * (live.max_model_len + 8)])  # found after tokenizing
    assert too_long["param"] == "prompt" and "maximum context length" in too_long["message"]
    assert bad(prompt=[[5, 6], [10 ** 9]])["param"] == "prompt"  # out of the vocabulary
    _no_admission_held(live, model_name)
