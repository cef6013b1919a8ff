"""A replica killed with SIGKILL mid-request: clients get a clear error promptly, never a hang; a new replica
serves again (DESIGN.md §5-6: heartbeats, the api's watchdog)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

MODEL = "tiny-qwen3"


def test_sigkill_engine_mid_stream_and_mid_request(live):
    engine = next(c for c in live.sup.children if c.name == "engine")
    h = {"Authorization": f"Bearer {live.api_key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 480, "ignore_eos": True}
    result: dict = {}

    def blocking_request():
        t0 = time.monotonic()
        r = httpx.post(live.base_url + "/v1/chat/completions", headers=h, json=body, timeout=60)
        result["status"], result["body"], result["s"] = r.status_code, r.json(), time.monotonic() - t0

    with httpx.Client(timeout=60) as http:
        with http.stream("POST", live.base_url + "/v1/chat/completions", headers=h,
                         json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = 0
            while got < 3:
                got += next(lines).startswith("data: ")
            t = threading.Thread(target=blocking_request)
            t.start()
            time.sleep(0.3)
            os.kill(engine.proc.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            events = [line[6:] for line in lines if line.startswith("data: ")]
            waited = time.monotonic() - killed_at
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "engine_error" and "stopped responding" in err["message"]
    assert waited < 10, waited  # heartbeat TTL 3 s + watchdog 1 s, not the 480 tokens
    t.join(30)
    assert result["status"] == 503 and result["body"]["error"]["code"] == "engine_error", result
    assert result["s"] < 15

    # no replica: a new request is refused at once with 503, not queued forever
    live.sup.children.remove(engine)
    deadline = time.monotonic() + 10
    while live.replicas() and time.monotonic() < deadline:
        time.sleep(0.2)
    r = httpx.post(live.base_url + "/v1/chat/completions", headers=h, json={**body, "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert int(r.headers["retry-after"]) >= 1

    # a new replica takes over and serves
    live.start_engine()
    r = httpx.post(live.base_url + "/v1/chat/completions", headers=h, json={**body, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
