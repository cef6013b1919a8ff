"""Admission end to end: real api processes (two), Celery worker, engine and Redis (docs/ARCHITECTURE.md §3)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from inference.api import admission as adm
from tests.support.live import engine_paused

MODEL = "tiny-qwen3"
pytestmark = pytest.mark.timeout(120)


def set_limits(live, reqs=None, tokens=None) -> None:
    live.manage("admission_policy", MODEL, "--max-num-queued-reqs", "none" if reqs is None else str(reqs),
                "--max-num-queued-tokens", "none" if tokens is None else str(tokens))


def snap(live) -> dict:
    return adm.model_snapshot(live.redis, live.prefix, MODEL)


def counters(live) -> tuple[int, int]:
    s = snap(live)
    return s["queued_reqs"], s["queued_tokens"]


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def headers(key):
    return {"Authorization": f"Bearer {key}"}


def completion(live, base, prompt_len, n=1, max_tokens=4, stream=False, **extra):
    body = {"model": MODEL, "prompt": [200 + i for i in range(prompt_len)], "max_tokens": max_tokens, "n": n,
            "stream": stream, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, headers=headers(live.api_key), timeout=60)


def in_background(fn, *args, **kwargs):
    out = {}

    def run():
        try:
            out["resp"] = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            out["exc"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def task_meta_count(live) -> int:
    """Render tasks answered by the Celery workers so far (their shared Redis counter)."""
    from inference.workers.tasks import render_tasks_counter_key

    return int(live.redis.get(render_tasks_counter_key(live.prefix)) or 0)


def test_boundaries_n_and_idle_rule_across_two_processes(live):
    api1, api2 = live.base_url, live.extra["api2"]
    set_limits(live, reqs=3)
    with engine_paused(live):
        a = in_background(completion, live, api1, 100, n=2)       # 2 requests, 200 tokens
        wait_for(lambda: counters(live) == (2, 200), 60, "A admitted")
        b = in_background(completion, live, api2, 50)             # 3 == limit: admitted
        wait_for(lambda: counters(live) == (3, 250), 60, "B admitted")
        refused = completion(live, api1, 1)                       # one more: refused
    assert refused.status_code == 503, refused.text
    err = refused.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "server_overloaded"
    assert "max_num_queued_reqs is 3" in err["message"] and int(refused.headers["retry-after"]) >= 1
    for t, out in (a, b):
        t.join(30)
        assert out["resp"].status_code == 200, out
    wait_for(lambda: counters(live) == (0, 0), 60, "release on finish")

    set_limits(live, tokens=250)
    with engine_paused(live):
        a = in_background(completion, live, api1, 100, n=2)
        wait_for(lambda: counters(live) == (2, 200), 60, "A admitted")
        over = completion(live, api2, 51)                         # 251 > 250: refused (own tokens count)
        b = in_background(completion, live, api2, 50)             # 250 == limit: admitted
        wait_for(lambda: counters(live) == (3, 250), 60, "B admitted")
    assert over.status_code == 503 and "max_num_queued_tokens is 250" in over.json()["error"]["message"]
    for t, out in (a, b):
        t.join(30)
        assert out["resp"].status_code == 200, out
    wait_for(lambda: counters(live) == (0, 0), 60, "release on finish")

    set_limits(live, tokens=10)
    r = completion(live, api1, 300)                               # idle queue: a long prompt still runs
    assert r.status_code == 200, r.text
    s = snap(live)
    assert s["refused"]["max_num_queued_reqs"] >= 1 and s["refused"]["max_num_queued_tokens"] >= 1
    assert s["ttft_count"] >= 4


def test_streaming_refusal_is_http_503_and_never_renders(live):
    set_limits(live)
    before = task_meta_count(live)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    ok = httpx.post(f"{live.base_url}/v1/chat/completions", json=chat, headers=headers(live.api_key), timeout=60)
    assert ok.status_code == 200
    assert wait_for(lambda: task_meta_count(live) > before, 60, "render task result")  # the counter works
    per_chat = task_meta_count(live) - before
    set_limits(live, reqs=0)  # drain: refuse everything
    before = task_meta_count(live)
    for base in (live.base_url, live.extra["api2"]):
        with httpx.stream("POST", f"{base}/v1/chat/completions", json={**chat, "stream": True},
                          headers=headers(live.api_key), timeout=30) as resp:
            body = resp.read()
            assert resp.status_code == 503
            assert resp.headers["content-type"].startswith("application/json")
            assert int(resp.headers["retry-after"]) >= 1
            assert b"data:" not in body and b"max_num_queued_reqs" in body
    # a request the limit lets through again is rendered and counted: had a refused one been sent to a worker,
    # it would have been answered (and counted) before this one
    set_limits(live)
    fresh = {**chat, "messages": [{"role": "user", "content": "hello, once more"}]}  # not a cached render
    assert httpx.post(f"{live.base_url}/v1/chat/completions", json=fresh, headers=headers(live.api_key),
                      timeout=60).status_code == 200
    wait_for(lambda: task_meta_count(live) > before, 60, "the admitted request's render")
    assert task_meta_count(live) == before + per_chat, "a refused request reached a render worker"
    set_limits(live)


def test_releases_on_disconnect_and_engine_error(live):
    set_limits(live)
    # disconnect of a streaming client while it waits for its first token
    with engine_paused(live):
        with httpx.stream("POST", f"{live.base_url}/v1/completions", headers=headers(live.api_key), timeout=10,
                          json={"model": MODEL, "prompt": list(range(300, 340)), "max_tokens": 50, "n": 3,
                                "stream": True}) as resp:
            assert resp.status_code == 200
            wait_for(lambda: counters(live) == (3, 120), 60, "stream admitted")
        wait_for(lambda: counters(live) == (0, 0), 60, "release on disconnect")
    # disconnect of a non-streaming client (handler cancelled)
    with engine_paused(live):
        raw = json.dumps({"model": MODEL, "prompt": [5] * 30, "max_tokens": 5}).encode()
        port = int(live.base_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer " + live.api_key.encode() + b"\r\nContent-Length: "
                         + str(len(raw)).encode() + b"\r\n\r\n" + raw)
            wait_for(lambda: counters(live) == (1, 30), 60, "admitted")
        # the client closed its connection while waiting for the answer (the engine is still stopped)
        wait_for(lambda: counters(live) == (0, 0), 60, "release on abort")
    # engine error: the replica stops heart-beating while the request waits
    pid = live.replicas()[0].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        t, out = in_background(completion, live, live.base_url, 25)
        wait_for(lambda: counters(live) == (1, 25), 60, "admitted")
        t.join(120)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert out["resp"].status_code == 503 and out["resp"].json()["error"]["code"] in ("engine_error",
                                                                                      "engine_unavailable")
    assert counters(live) == (0, 0)
    wait_for(lambda: live.replicas(), 60, "engine heartbeat back")


def test_disconnect_right_after_admission_releases_every_time(live):
    """A client that hangs up the moment its request is admitted: the handler's cancellation lands in the middle of
    its Redis calls, where Python 3.11's ``asyncio.wait_for`` (redis-py's send) can lose it; the reservation must be
    released anyway (gateway/disconnect.py), every time, while the engine still holds the request."""
    set_limits(live)
    port = int(live.base_url.rsplit(":", 1)[1])
    with engine_paused(live):
        for i in range(20):
            raw = json.dumps({"model": MODEL, "prompt": [9 + i] * 30, "max_tokens": 5}).encode()
            with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
                conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                             b"\r\nAuthorization: Bearer " + live.api_key.encode() + b"\r\nContent-Length: "
                             + str(len(raw)).encode() + b"\r\n\r\n" + raw)
                wait_for(lambda: counters(live) == (1, 30), 30, f"request {i} admitted")
            wait_for(lambda: counters(live) == (0, 0), 15, f"release of request {i} on disconnect")


def test_burst_of_200_never_over_admits(live):
    limit = 8
    set_limits(live, reqs=limit)
    seen = []
    stop = threading.Event()

    def sample():
        r = live.redis
        while not stop.is_set():
            seen.append(int(r.hget(adm.state_key(live.prefix, MODEL), "reqs") or 0))
            time.sleep(0.002)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    async def burst():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=400)) as client:
            async def one(i):
                base = live.base_url if i % 2 else live.extra["api2"]
                r = await client.post(f"{base}/v1/completions", headers=headers(live.api_key),
                                      json={"model": MODEL, "prompt": [7 + i % 50] * 20, "max_tokens": 8})
                return r.status_code
            return await asyncio.gather(*(one(i) for i in range(200)))
    try:
        codes = asyncio.run(burst())
    finally:
        stop.set()
        sampler.join()
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= limit and codes.count(503) > 0
    assert max(seen) <= limit, max(seen)
    wait_for(lambda: counters(live) == (0, 0), 60, "all released")


def test_limit_edit_applies_at_once_to_both_processes(live):
    """The limits are read from Redis by the admission script of every request: the very next request on
    either process sees an edit (no cache to wait out, no restart)."""
    set_limits(live)
    for value, want in ((0, 503), (None, 200)):
        set_limits(live, reqs=value)
        for base in (live.base_url, live.extra["api2"]):
            assert completion(live, base, 3).status_code == want


def test_kill_9_of_api_process_recovers(live):
    """The dead process's reservations are reaped once its lease expires (``LEASE_TTL_S``); the counters do not
    wait for its requests, which nobody will ever finish."""
    set_limits(live)
    child, base3 = live.start_api("api3")
    with engine_paused(live):
        for _ in range(2):
            in_background(completion, live, base3, 40, n=2, max_tokens=200)
        wait_for(lambda: counters(live) == (4, 160), 60, "api3 holds reservations")
        os.kill(child.proc.pid, signal.SIGKILL)
    assert counters(live)[0] > 0
    wait_for(lambda: counters(live) == (0, 0), 60, "counters recovered after kill -9")


def test_a_fresh_api_reaps_dead_reservations_before_any_request(live):
    """The lease loop starts with the api process (ASGI lifespan, gateway/lifespan.py), not at its first request: an
    api started on a key prefix of its own, that no request ever reaches, reaps a reservation whose holder died
    (planted by a holder that stops refreshing its lease). Nothing else runs on that prefix, so only it can."""
    prefix = f"{live.prefix}lf"
    # processes an earlier test killed on purpose (api3) would fail the supervisor's wait for this one
    live.sup.children[:] = [c for c in live.sup.children if c.proc is None or c.proc.poll() is None]
    child, _base = live.start_api("api-lifespan", env_extra={"LINK_PREFIX": prefix})
    try:
        async def plant() -> None:
            import redis.asyncio as aioredis

            dead = adm.Admission(redis=aioredis.Redis.from_url(live.redis_url), prefix=prefix)
            await dead.precheck(MODEL, "req-of-a-dead-api", 2, 30)  # its lease loop never runs: a dead holder
            await dead.redis.aclose()
        asyncio.run(plant())
        planted = time.monotonic()
        assert adm.model_snapshot(live.redis, prefix, MODEL)["queued_reqs"] == 2
        wait_for(lambda: adm.model_snapshot(live.redis, prefix, MODEL)["queued_reqs"] == 0,
                 adm.LEASE_TTL_S + adm.LEASE_REFRESH_S + 5, "the request-less api to reap the dead reservation")
        assert time.monotonic() - planted >= adm.LEASE_TTL_S - 0.5  # reaped by the lease, not by accident
        assert adm.model_snapshot(live.redis, prefix, MODEL)["queued_tokens"] == 0
    finally:
        os.killpg(child.proc.pid, signal.SIGTERM)
        child.proc.wait(30)
        live.sup.children.remove(child)
        for key in live.redis.scan_iter(match=f"{prefix}:*"):
            live.redis.delete(key)


def test_metrics_endpoint(live):
    r = httpx.get(f"{live.base_url}/metrics")
    assert r.status_code == 401
    r = httpx.get(f"{live.base_url}/metrics", headers=headers(live.api_key))
    assert r.status_code == 403
    s = snap(live)
    texts = [httpx.get(f"{b}/metrics", headers=headers(live.extra["operator_key"])).text
             for b in (live.base_url, live.extra["api2"])]
    for text in texts:
        line = (f'admission_rejections_total{{model="{MODEL}",reason="max_num_queued_reqs"}} '
                f'{float(s["refused"]["max_num_queued_reqs"])}')
        assert line in text, text
        assert f'admission_queued_requests{{model="{MODEL}"}}' in text
        assert f'time_to_first_token_seconds_count{{model="{MODEL}"}} {float(s["ttft_count"])}' in text
        assert f'time_to_first_token_seconds_bucket{{le="+Inf",model="{MODEL}"}}' in text
        # where that TTFT went: one observation per phase with each TTFT, the phases within it
        assert s["ttft_count"] > 0
        for phase in adm.LATENCY_PHASES:
            assert f'request_{phase}_time_seconds_count{{model="{MODEL}"}} {float(s["ttft_count"])}' in text, phase
            assert f'request_{phase}_time_seconds_bucket{{le="+Inf",model="{MODEL}"}}' in text
    assert 0 < sum(s["latency"][phase]["sum"] for phase in adm.LATENCY_PHASES) < s["ttft_sum"]
