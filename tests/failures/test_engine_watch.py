"""``serve``'s heartbeat watch (``platform/ops/engine_watch.py``) over real Redis: which live engine processes it
calls unresponsive, and when. Heartbeats are written as a replica writes them (``EngineStats`` under
``replica_key``, the index scored by expiry); the clock is passed in, one read a second as ``serve`` reads. The
drill ``engine-hang`` (``tests/failures/test_drills.py``) runs the same watch inside a live ``serve``."""

from __future__ import annotations

import os
import time
import uuid

import pytest
import redis

from inference.protocol.engine import EngineStats, replica_key, replicas_index_key
from ops.engine_watch import OUTAGE_S, HeartbeatWatch

MODEL = "m"
HOST = "this-host"


@pytest.fixture
def r():
    client = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/3"))
    prefix = f"tw{uuid.uuid4().hex[:8]}"
    client.prefix = prefix  # type: ignore[attr-defined]
    yield client
    keys = list(client.scan_iter(f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)


def beat(r, engine_id: str, pid: int, host: str = HOST) -> None:
    """One heartbeat of replica ``engine_id`` (process ``pid`` on ``host``), as ``ReplicaLink`` writes it."""
    st = EngineStats(engine_id=engine_id, model=MODEL, pid=pid, device="cpu", max_num_seqs=8, host=host)
    r.set(replica_key(r.prefix, MODEL, engine_id), st.to_wire(), px=3000)
    r.zadd(replicas_index_key(r.prefix, MODEL), {engine_id: int(time.time() * 1000) + 3000})


def lapse(r, engine_id: str) -> None:
    """The heartbeat of ``engine_id`` lapses (its key expires, its index score passes)."""
    r.delete(replica_key(r.prefix, MODEL, engine_id))
    r.zadd(replicas_index_key(r.prefix, MODEL), {engine_id: int(time.time() * 1000) - 1})


def watch_for(r, unresponsive_s: float = 60.0) -> HeartbeatWatch:
    return HeartbeatWatch(r, r.prefix, [MODEL], unresponsive_s, host=HOST)


def test_a_lapsed_heartbeat_is_unresponsive_only_past_the_bound(r):
    w = watch_for(r)
    beat(r, "a", 101)
    beat(r, "b", 102)
    assert w.unresponsive([101, 102], now=1000.0) == []
    lapse(r, "a")
    for t in range(1, 61):  # one read a second, as serve reads; b keeps beating
        beat(r, "b", 102)
        assert w.unresponsive([101, 102], now=1000.0 + t) == [], t
    assert w.unresponsive([101, 102], now=1061.0) == [101]


def test_a_replica_never_seen_beating_is_not_judged(r):
    """Loading a model takes minutes without a heartbeat: a process only counts once it has beaten."""
    w = watch_for(r, unresponsive_s=5.0)
    for t in range(0, 30):
        assert w.unresponsive([201], now=2000.0 + t) == []


def test_a_replica_of_another_host_with_the_same_pid_does_not_stand_in(r):
    w = watch_for(r, unresponsive_s=5.0)
    beat(r, "local", 301)
    assert w.unresponsive([301], now=3000.0) == []
    lapse(r, "local")
    beat(r, "remote", 301, host="other-host")  # the same pid on another machine sharing the Redis
    for t in range(1, 6):
        assert w.unresponsive([301], now=3000.0 + t) == []
    assert w.unresponsive([301], now=3006.0) == [301]


def test_a_redis_outage_restarts_the_clocks(r):
    """No heartbeat can be written while Redis is away: a gap between answered reads longer than ``OUTAGE_S``
    starts every replica's clock again, and a read that fails judges nobody."""
    w = watch_for(r, unresponsive_s=10.0)
    beat(r, "a", 401)
    assert w.unresponsive([401], now=4000.0) == []
    lapse(r, "a")
    # an outage of 30 s: the next answered read comes 30 s later and finds no heartbeat (nothing could write one)
    assert w.unresponsive([401], now=4030.0) == []
    for t in range(31, 41):
        assert w.unresponsive([401], now=4000.0 + t) == [], t
    assert w.unresponsive([401], now=4041.0) == [401]
    assert OUTAGE_S < 30

    down = HeartbeatWatch(redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1), r.prefix, [MODEL], 1.0,
                          host=HOST)  # nothing listens on loopback port 1: every read fails
    assert down.unresponsive([401], now=5000.0) == []


def test_an_exited_process_is_forgotten(r):
    """A pid that no longer lives is dropped, so a new process that reuses it starts unseen."""
    w = watch_for(r, unresponsive_s=5.0)
    beat(r, "a", 501)
    assert w.unresponsive([501], now=6000.0) == []
    lapse(r, "a")
    assert w.unresponsive([], now=6001.0) == []  # 501 exited (serve restarts it)
    for t in range(2, 20):  # a new process that happens to get pid 501 loads a model, no heartbeat yet
        assert w.unresponsive([501], now=6000.0 + t) == [], t
