"""A replica killed with SIGKILL mid-request: clients get a clear error promptly, never a hang; a new replica
serves again (DESIGN.md §5-6: heartbeats, the api's watchdog)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from inference.protocol.engine import requests_stream

MODEL = "tiny-qwen3"


def test_sigkill_engine_mid_stream_and_mid_request(live):
    engine = next(c for c in live.sup.children if c.name == "engine")
    h = {"Authorization": f"Bearer {live.api_key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 480, "ignore_eos": True}
    result: dict = {}

    def blocking_request():
        r = httpx.post(live.base_url + "/v1/chat/completions", headers=h, json=body, timeout=120)
        result["status"], result["body"] = r.status_code, r.json()

    with httpx.Client(timeout=60) as http:
        with http.stream("POST", live.base_url + "/v1/chat/completions", headers=h,
                         json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = 0
            while got < 3:
                got += next(lines).startswith("data: ")
            # freeze the engine mid-stream (however fast it decodes, neither request can finish now), let the
            # second request reach it, then kill it
            os.kill(engine.proc.pid, signal.SIGSTOP)
            stream = requests_stream(live.prefix, MODEL)
            sent = live.redis.xlen(stream)
            t = threading.Thread(target=blocking_request)
            t.start()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and live.redis.xlen(stream) == sent:
                time.sleep(0.05)
            assert live.redis.xlen(stream) > sent, "the second request never reached the engine link"
            os.kill(engine.proc.pid, signal.SIGKILL)
            events = [line[6:] for line in lines if line.startswith("data: ")]
    # both end with the engine error (heartbeat TTL 3 s + watchdog 1 s), not after 480 tokens nor never
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "engine_error" and "stopped responding" in err["message"]
    t.join(120)
    assert result["status"] == 503 and result["body"]["error"]["code"] == "engine_error", result

    # no replica: a new request is refused at once with 503, not queued forever
    live.sup.children.remove(engine)
    deadline = time.monotonic() + 60
    while live.replicas() and time.monotonic() < deadline:
        time.sleep(0.2)
    r = httpx.post(live.base_url + "/v1/chat/completions", headers=h, json={**body, "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert int(r.headers["retry-after"]) >= 1

    # a new replica takes over and serves
    live.start_engine()
    r = httpx.post(live.base_url + "/v1/chat/completions", headers=h, json={**body, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
