"""A replica killed with SIGKILL mid-request: clients get a clear error promptly, never a hang; a new replica
serves again (docs/ARCHITECTURE.md §5-6: heartbeats, the api's watchdog). With two replicas: a conversation's turns are
routed to the replica holding its prefix, and one routed to a replica that stops is taken over by the other (issue
18)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from openai import OpenAI

from inference.api import admission as adm
from inference.protocol.engine import replica_requests_stream, routing_key

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
            (replica,) = live.replicas()
            os.kill(engine.proc.pid, signal.SIGSTOP)
            stream = replica_requests_stream(live.prefix, MODEL, replica.engine_id)  # the api routes to it
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


@pytest.mark.timeout(600)  # starts a second engine replica
def test_two_replicas_keep_a_conversation_on_one_and_take_over_from_a_stopped_one(live):
    """Runs after the test above (same platform): one replica, then a second. Later turns of a multi-turn chat
    land on the replica that served the first and report cached prompt tokens; a turn routed to that replica
    while it is frozen is taken over by the other once its heartbeat lapses (no hang); after it is killed the
    survivor serves, and no admission reservation is left."""
    if not live.replicas():
        live.start_engine()
    live.start_engine(name="engine-2")
    assert len(live.replicas()) == 2
    r = live.redis
    client = OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, timeout=90, max_retries=0)

    def routed() -> dict[str, int]:
        return {k.decode().split(":", 1)[1]: int(v) for k, v in r.hgetall(routing_key(live.prefix, MODEL)).items()
                if k.startswith(b"requests:")}

    def turn(messages: list, content: str) -> int:
        messages.append({"role": "user", "content": content})
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
        messages.append({"role": "assistant", "content": resp.choices[0].message.content or ""})
        details = resp.usage.prompt_tokens_details  # type: ignore[union-attr]
        return details.cached_tokens or 0 if details is not None else 0  # omitted when nothing was cached

    messages: list = [{"role": "system", "content": "You answer briefly and precisely. " * 12}]
    before = routed()
    cached = [turn(messages, f"Question {i}: what is {i} times seven?") for i in range(3)]
    grew = {e: n - before.get(e, 0) for e, n in routed().items() if n != before.get(e, 0)}
    assert len(grew) == 1 and sum(grew.values()) == 3, grew  # every turn on one replica
    assert cached[1] > 0 and cached[2] > cached[1], cached  # the history was not prefilled again
    (holder,) = grew
    # the replica reports its counters with its heartbeat (about once a second): wait for the one after the turns
    def hits() -> int:
        return next((s.prefix_hit_tokens for s in live.replicas() if s.engine_id == holder), 0)
    deadline = time.monotonic() + 10
    while hits() < cached[1] + cached[2] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hits() >= cached[1] + cached[2], (hits(), cached)
    st = {s.engine_id: s for s in live.replicas()}
    metrics_key = live.new_key(scopes="metrics")
    text = httpx.get(live.base_url + "/metrics", headers={"Authorization": f"Bearer {metrics_key}"}).text
    assert f'engine_routed_requests_total{{engine_id="{holder}",model="{MODEL}"}}' in text
    assert f'engine_prefix_cache_hit_tokens_total{{engine_id="{holder}",model="{MODEL}"}}' in text

    # freeze the holder: the next turn is routed to it (still heart-beating for up to 3 s) and waits in its stream
    # until its heartbeat lapses and the other replica takes it over
    survivor = next(e for e in st if e != holder)
    os.kill(st[holder].pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        turn(messages, "One more question: and eight times seven?")
        took = time.monotonic() - t0
        assert routed()[holder] - before.get(holder, 0) == 4  # it was sent to the frozen replica ...
        assert {s.engine_id for s in live.replicas()} == {survivor}  # ... and served by the survivor
        assert took < 60, took  # heartbeat TTL 3 s + takeover every 1 s, on a loaded machine
    finally:
        os.kill(st[holder].pid, signal.SIGKILL)
    for child in [c for c in live.sup.children if c.proc is not None and c.proc.pid == st[holder].pid]:
        live.sup.children.remove(child)
    # the survivor holds the conversation now: the next turn hits its cache
    assert turn(messages, "Last one: nine times seven?") > 0
    assert routed()[survivor] > before.get(survivor, 0)
    deadline = time.monotonic() + 15
    while adm.model_snapshot(r, live.prefix, MODEL)["queued_reqs"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert adm.model_snapshot(r, live.prefix, MODEL)["queued_reqs"] == 0
