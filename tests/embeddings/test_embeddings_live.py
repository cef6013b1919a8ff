"""``POST /v1/embeddings`` end to end: real api, Redis, Celery and a pooling-mode engine replica."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from tests.embeddings.conftest import EMBED_MODEL
from harness.minilm_reference import DirectMiniLM
from harness.assets import minilm_dir
from tests.support.live import post_json


def post(live, path: str, body: dict, key: str | None = None, timeout: float = 60):
    return post_json(live, path, body, key=key, timeout=timeout)


@pytest.fixture(scope="module")
def direct():
    return DirectMiniLM(minilm_dir())


def vecs(body) -> np.ndarray:
    return np.array([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])], dtype=np.float32)


def test_matches_transformers_and_semantics(live_embed, direct):
    texts = ["a cat", "a kitten", "a carburetor"]
    status, body = post(live_embed, "/v1/embeddings", {"model": EMBED_MODEL, "input": texts})
    assert status == 200, body
    got = vecs(body)
    ref = direct.embed(texts).numpy()
    assert got.shape == (3, 384)
    assert float(np.abs(got - ref).max()) <= 1e-5
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert body["object"] == "list" and body["model"] == EMBED_MODEL
    n_tokens = sum(len(direct.tok(t)["input_ids"]) for t in texts)
    assert body["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    cat, kitten, carb = got
    assert float(cat @ kitten) > float(cat @ carb) + 0.1


def test_input_forms_and_base64(live_embed, direct):
    ids = direct.tok("a kitten")["input_ids"]
    ref = direct.embed(["a kitten"]).numpy()[0]
    for inp in ("a kitten", ["a kitten"], ids, [ids]):
        status, body = post(live_embed, "/v1/embeddings", {"model": EMBED_MODEL, "input": inp})
        assert status == 200, (inp, body)
        assert len(body["data"]) == 1
        assert float(np.abs(vecs(body)[0] - ref).max()) <= 1e-5
    status, body = post(live_embed, "/v1/embeddings", {"model": EMBED_MODEL, "input": "a kitten",
                                                       "encoding_format": "base64"})
    assert status == 200
    v = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert float(np.abs(v - ref).max()) <= 1e-5
    # the float list is lossless: its decimals read back to exactly the float32 values of the base64 form
    status, body = post(live_embed, "/v1/embeddings", {"model": EMBED_MODEL, "input": "a kitten"})
    as_floats = body["data"][0]["embedding"]
    assert all(isinstance(x, float) for x in as_floats)
    assert np.array_equal(np.array(as_floats, dtype=np.float32), v)


def test_openai_sdk(live_embed, direct):
    from openai import OpenAI

    client = OpenAI(base_url=live_embed.base_url + "/v1", api_key=live_embed.api_key)
    res = client.embeddings.create(model=EMBED_MODEL, input=["a cat", "a kitten"])  # SDK asks base64
    got = np.array([d.embedding for d in res.data], dtype=np.float32)
    assert float(np.abs(got - direct.embed(["a cat", "a kitten"]).numpy()).max()) <= 1e-5
    assert res.usage.prompt_tokens > 0


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input[1]"),
    ({"input": [[1, 2], []]}, "input[1]"),
    ({"input": ["ok", [1, 2]]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": None}, "input"),
    ({"input": "x", "dimensions": 128}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens"),
    ({"input": [999999]}, "input"),
])
def test_bad_requests_are_400(live_embed, body, param):
    status, out = post(live_embed, "/v1/embeddings", {"model": EMBED_MODEL, **body})
    assert status == 400, out
    assert out["error"]["type"] == "invalid_request_error"
    assert out["error"]["param"] == param, out


def test_too_long_is_400_unless_truncated(live_embed, direct):
    text = "word " * 400  # > 256 tokens
    status, out = post(live_embed, "/v1/embeddings", {"model": EMBED_MODEL, "input": text})
    assert status == 400 and "truncate_prompt_tokens" in out["error"]["message"]
    assert out["error"]["code"] == "context_length_exceeded", out
    # past the character bound (max_model_len × the longest token string) truncation cannot help: the message
    # says so instead of advising it
    for extra in ({}, {"truncate_prompt_tokens": 16}):
        status, out = post(live_embed, "/v1/embeddings", {"model": EMBED_MODEL, "input": "hello " * 4000, **extra})
        assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
        assert ("within that bound only" in out["error"]["message"]) == bool(extra), out
    status, out = post(live_embed, "/v1/embeddings", {"model": EMBED_MODEL, "input": text,
                                                      "truncate_prompt_tokens": -1})
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] == 256
    ref = direct.embed([text], max_length=256).numpy()[0]
    assert float(np.abs(vecs(out)[0] - ref).max()) <= 1e-5
    status, out = post(live_embed, "/v1/embeddings", {"model": EMBED_MODEL, "input": text,
                                                      "truncate_prompt_tokens": 10})
    assert status == 200 and out["usage"]["prompt_tokens"] == 10
    assert float(np.abs(vecs(out)[0] - direct.embed([text], max_length=10).numpy()[0]).max()) <= 1e-5


def test_auth_model_task_and_models_list(live_embed):
    status, out = post(live_embed, "/v1/embeddings", {"model": EMBED_MODEL, "input": "x"}, key="wrong")
    assert status == 401
    status, out = post(live_embed, "/v1/embeddings", {"model": "tiny-qwen3", "input": "x"})
    assert status == 400 and out["error"]["param"] == "model"
    # and the other way round: generation routes refuse an embedding model up front (it was a 503 engine_error
    # from the replica, which clients retry)
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions/render", {"prompt": "hi"}),
                       ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "hi"}]})):
        status, out = post(live_embed, path, {"model": EMBED_MODEL, **body})
        assert status == 400, (path, out)
        assert (out["error"]["code"], out["error"]["param"]) == ("model_not_generative", "model"), (path, out)
    status, out = post(live_embed, "/v1/embeddings", {"model": "nope", "input": "x"})
    assert status == 404
    req = urllib.request.Request(live_embed.base_url + "/v1/models",
                                 headers={"Authorization": f"Bearer {live_embed.api_key}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        ids = [m["id"] for m in json.loads(resp.read())["data"]]
    assert EMBED_MODEL in ids


def test_concurrent_requests_are_batched_and_correct(live_embed, direct):
    texts = [f"sentence number {i} about cats" for i in range(24)]
    ref = direct.embed(texts).numpy()

    def one(i):
        return post(live_embed, "/v1/embeddings", {"model": EMBED_MODEL, "input": texts[i]})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(len(texts))))
    for i, (status, body) in enumerate(results):
        assert status == 200
        assert float(np.abs(vecs(body)[0] - ref[i]).max()) <= 1e-5


def test_usage_recorded(live_embed):
    key = live_embed.new_key()
    status, body = post(live_embed, "/v1/embeddings", {"model": EMBED_MODEL, "input": ["a cat", "a dog"]}, key=key)
    assert status == 200
    expected = body["usage"]["prompt_tokens"]
    script = ("from usage.models import UsageRecord as U; "
              "print([(r.endpoint, r.prompt_tokens, r.completion_tokens, r.status_code) for r in "
              f"U.objects.filter(served_model_name='{EMBED_MODEL}', api_key__prefix='{key[:11]}')])")
    deadline = time.monotonic() + 60
    out = ""
    while time.monotonic() < deadline:
        out = live_embed.manage("shell", "-c", script)
        if "embeddings" in out:
            break
        time.sleep(0.5)
    assert f"('embeddings', {expected}, 0, 200)" in out, out


def test_inputs_of_one_call_reach_the_engine_together_and_run_in_one_forward(live_embed, direct):
    """The api sends one call's requests in one MULTI/EXEC, so the blocked replica reads them all at once: a
    plain pipeline woke it at the first XADD and it ran that input alone, then the rest (two forwards)."""
    import asyncio
    import uuid

    from inference.api.engine_client import EngineLink
    from inference.protocol.engine import EngineCoreRequest, SamplingParams

    ids = [direct.tok(f"input number {i}")["input_ids"] for i in range(16)]

    async def run() -> list:
        link = EngineLink.for_current_process(live_embed.redis_url, live_embed.prefix)
        try:
            outs = []
            for _attempt in range(3):  # the replica must be idle, blocked in XREADGROUP, for this to matter
                await asyncio.sleep(0.3)
                reqs = [EngineCoreRequest(request_id=f"b-{uuid.uuid4().hex[:8]}", external_req_id="b",
                                          prompt_token_ids=t, sampling_params=SamplingParams(max_tokens=1),
                                          client_id=link.client_id, arrival_time=0.0, pooling=True) for t in ids]
                queue: asyncio.Queue = asyncio.Queue()
                await link.add_requests(EMBED_MODEL, reqs, queue)
                done = []
                while len(done) < len(reqs):
                    out = await asyncio.wait_for(queue.get(), 30)
                    if out.finish_reason:
                        done.append(out)
                for r in reqs:
                    link.release(r.request_id)
                outs.append(done)
            return outs
        finally:
            await link.close()

    for done in asyncio.run(run()):
        assert all(o.pooled for o in done)
        assert len({o.scheduled_ts for o in done}) == 1  # one engine step ran all 16


def test_the_link_deletes_delivered_outputs_and_refuses_a_model_without_replicas(live_embed, direct):
    """Delivered output entries leave the api's output stream (deleted in the same round trip as the next read);
    a model no replica serves is refused at once even right after another model's replica was seen."""
    import asyncio
    import uuid

    from inference.api.engine_client import EngineLink, EngineUnavailableError
    from inference.protocol.engine import EngineCoreRequest, SamplingParams, outputs_stream

    def request(link, i):
        return EngineCoreRequest(request_id=f"d-{uuid.uuid4().hex[:8]}", external_req_id="d",
                                 prompt_token_ids=direct.tok(f"input {i}")["input_ids"],
                                 sampling_params=SamplingParams(max_tokens=1), client_id=link.client_id,
                                 arrival_time=0.0, pooling=True)

    async def run() -> tuple[int, int]:
        link = EngineLink.for_current_process(live_embed.redis_url, live_embed.prefix)
        key = outputs_stream(live_embed.prefix, link.client_id)
        try:
            for round_ in range(3):
                reqs = [request(link, 10 * round_ + i) for i in range(4)]
                queues = await link.add_requests(EMBED_MODEL, reqs)
                for r in reqs:
                    while not (await asyncio.wait_for(queues[r.request_id].get(), 30)).finish_reason:
                        pass
            length = -1
            for _ in range(100):
                length = await link.redis.xlen(key)
                if length == 0:
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(EngineUnavailableError):
                await link.add_requests("no-such-model", [request(link, 99)])
            return length, link.num_tracked
        finally:
            await link.close()

    length, tracked = asyncio.run(run())
    assert length == 0
    assert tracked == 0


def test_an_abort_leaves_the_pooling_replica_running(live_embed, direct):
    """An abort that reaches the pooling replica (a client that hung up on /v1/embeddings) leaves it serving: the
    engine's abort freed the runner's KV state of the aborted requests, which a pooling runner did not have, and the
    replica died on the first abort (a second fresh-eyes check, 2026-12-02: five disconnects in a minute made
    ``serve`` give up and stop the platform)."""
    import asyncio
    import uuid

    from inference.api.engine_client import EngineLink
    from inference.protocol.engine import EngineCoreRequest, SamplingParams

    before = {s.engine_id: s.pid for s in live_embed.replicas(EMBED_MODEL)}

    async def send_and_abort() -> None:
        link = EngineLink.for_current_process(live_embed.redis_url, live_embed.prefix)
        try:
            reqs = [EngineCoreRequest(request_id=f"ab-{uuid.uuid4().hex[:8]}", external_req_id="ab",
                                      prompt_token_ids=direct.tok(f"text {i} " * 40)["input_ids"],
                                      sampling_params=SamplingParams(max_tokens=1), client_id=link.client_id,
                                      arrival_time=0.0, pooling=True) for i in range(16)]
            await link.add_requests(EMBED_MODEL, reqs)
            await link.abort(EMBED_MODEL, [r.request_id for r in reqs])
            await asyncio.sleep(1.5)  # the replica reads the aborts (its poll), then beats again
        finally:
            await link.close()

    asyncio.run(send_and_abort())
    assert {s.engine_id: s.pid for s in live_embed.replicas(EMBED_MODEL)} == before
    counted = sum(s.prompt_tokens for s in live_embed.replicas(EMBED_MODEL))
    status, out = post(live_embed, "/v1/embeddings", {"model": EMBED_MODEL, "input": "still serving"})
    assert status == 200, out
    # and the replica counts the prompt tokens it pooled (engine_prompt_tokens_total stayed 0 for embeddings)
    deadline = time.monotonic() + 10
    while sum(s.prompt_tokens for s in live_embed.replicas(EMBED_MODEL)) < counted + out["usage"]["prompt_tokens"]:
        assert time.monotonic() < deadline, live_embed.replicas(EMBED_MODEL)
        time.sleep(0.2)
