"""The demo model served with ``backend=vllm`` through the live platform, with the official ``openai`` client.

A second served model, ``tiny-qwen3-vllm`` (the same directory), is registered on the package's live platform with
``--backend vllm`` and gets one vLLM engine replica (``python -m inference.engine.vllm_backend`` in vLLM's own
environment); the api process, admission, key limits and usage are the platform's, unchanged. Skipped when vLLM's
environment is missing (``scripts/setup.sh --vllm``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time

import httpx
import jsonschema
import openai
import pytest

from harness.assets import DEMO_MODEL, MODEL_DIR, VLLM_PYTHON
from tests.support.cache_salt import check_shared_only_within_a_tenant, check_shared_within_a_cache_group, salt_tenants

VLLM_MODEL = "tiny-qwen3-vllm"
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow, please."}]


@pytest.fixture(scope="module")
def vllm_model(live):
    """``tiny-qwen3-vllm`` registered with backend=vllm and served by one vLLM replica; disabled and stopped after."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (scripts/setup.sh --vllm)")
    live.manage("register_model", VLLM_MODEL, str(MODEL_DIR), "--max-model-len", str(live.max_model_len),
                "--backend", "vllm")
    child = live.start_engine("engine-vllm", model=VLLM_MODEL, backend="vllm")
    yield VLLM_MODEL
    with contextlib.suppress(ProcessLookupError):  # the last test stops it itself
        os.killpg(child.proc.pid, signal.SIGTERM)  # the link process and vLLM's engine-core process
    try:
        child.proc.wait(30)
    except subprocess.TimeoutExpired:
        pass
    live.sup.kill_group(child)
    live.sup.children.remove(child)
    live.manage("register_model", VLLM_MODEL, str(MODEL_DIR), "--enabled", "false")


@pytest.fixture(scope="module")
def oai(live):
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, max_retries=0, timeout=120)


def _idle(live, model: str, timeout_s: float = 30) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        reps = live.replicas(model)
        if reps and all(r.num_running == 0 and r.num_waiting == 0 for r in reps):
            return True
        time.sleep(0.2)
    return False


def test_chat_and_stream_agree_and_report_usage(oai, vllm_model, live):
    rep = live.replicas(vllm_model)
    assert len(rep) == 1 and rep[0].max_num_seqs == 32
    full = oai.chat.completions.create(model=vllm_model, messages=MESSAGES, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    native = oai.chat.completions.create(model=DEMO_MODEL, messages=MESSAGES, max_tokens=1, temperature=0)
    assert full.model == vllm_model and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == native.usage.prompt_tokens  # same template and tokenizer above the link
    chunks = list(oai.chat.completions.create(model=vllm_model, messages=MESSAGES, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content  # greedy: the same tokens, streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_logprobs_seed_and_stop_through_the_platform(oai, vllm_model):
    a = oai.chat.completions.create(model=vllm_model, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7,
                                   logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    b = oai.chat.completions.create(model=vllm_model, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7,
                                   extra_body={"ignore_eos": True})
    assert a.choices[0].message.content == b.choices[0].message.content
    entries = a.choices[0].logprobs.content
    assert len(entries) == 8 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


def test_prefix_cache_shows_as_cached_tokens(oai, vllm_model):
    long = [{"role": "user", "content": "Tell me about the sea. " * 40}]
    oai.chat.completions.create(model=vllm_model, messages=long, max_tokens=2)
    again = oai.chat.completions.create(model=vllm_model, messages=long, max_tokens=2)
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= 128  # vLLM's num_cached_tokens, whole blocks


def test_client_disconnect_aborts_on_vllm(oai, vllm_model, live):
    stream = oai.chat.completions.create(model=vllm_model, messages=MESSAGES, max_tokens=400, stream=True,
                                         extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got += 1
        if got >= 3:
            break
    stream.close()
    assert _idle(live, vllm_model), live.replicas(vllm_model)  # the engine request was aborted, slot freed


def test_json_schema_response_format_on_vllm(oai, vllm_model):
    """Our constraint travels as vLLM's ``StructuredOutputsParams`` (llguidance, as on the native engine)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    out = oai.chat.completions.create(model=vllm_model, messages=MESSAGES, max_tokens=60, temperature=1.0, n=2,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "x", "schema": schema}})
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_prefix_cache_is_shared_only_within_a_tenant_on_vllm(vllm_model, live):
    """Issue 39: the tenant's cache salt reaches vLLM (``TokensPrompt.cache_salt``): B does not get A's blocks."""
    check_shared_only_within_a_tenant(live, salt_tenants(live), vllm_model)


def test_prefix_cache_is_shared_within_a_cache_group_on_vllm(vllm_model, live):
    """Issue 39: two tenants of one ``cache_group`` share vLLM's cached blocks; one outside it does not."""
    check_shared_within_a_cache_group(live, salt_tenants(live), vllm_model)


def test_sigterm_of_the_vllm_replica_ends_its_stream_with_an_error_and_its_heartbeat(vllm_model, live):
    """Last in this module (it stops the module's replica): the vLLM backend's heartbeat is fresh (TTL at most 3 s);
    SIGTERM of its link process mid-stream makes it abort what it runs, tell the api (the client's stream ends with
    an ``engine_error`` event, then ``[DONE]``), remove its heartbeat and exit 0. (The engine package's
    ``test_heartbeat_and_sigterm`` checks the same at the link for the native engine; here a vLLM replica the
    platform already runs is used rather than starting a third one, ~60 s on 2 cores.)"""
    from inference.protocol.engine import replica_key

    [rep] = live.replicas(vllm_model)
    hb_key = replica_key(live.prefix, vllm_model, rep.engine_id)
    assert 0 < live.redis.pttl(hb_key) <= 3000
    child = next(c for c in live.sup.children if c.name == "engine-vllm")
    body = {"model": vllm_model, "messages": MESSAGES, "max_tokens": 400, "stream": True, "ignore_eos": True}
    events: list[str] = []
    with httpx.Client(base_url=live.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {live.api_key}"}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    child.proc.send_signal(signal.SIGTERM)
    assert child.proc.wait(60) == 0
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2]).get("error", {}).get("code") == "engine_error", (len(events), events[-3:])
    assert not live.redis.exists(hb_key)
