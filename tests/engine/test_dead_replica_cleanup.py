"""A replica long dead leaves nothing behind in Redis: a live replica of the model (``EngineCore._take_over``)
deletes the dead one's request stream and block set once the stream is empty, and its per-replica routing counts
with them, so ``/metrics`` does not keep a series for every replica ever started (D-280). A real engine core over
real Redis; the dead replica's keys are laid out as a replica that expired 55 s ago would have left them."""

from __future__ import annotations

import time

import pytest
import redis

from inference.engine.core import DEAD_STREAM_DROP_MS, ENGINE_GROUP, EngineCore
from inference.engine.runner import ModelRunner
from inference.protocol.engine import replica_blocks_key, replica_requests_stream, replicas_index_key, routing_key


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(str(model_dir), max_model_len=512)


def test_long_dead_replica_keys_and_routing_counts_are_dropped(runner, redis_url, link_prefix):
    prefix, model = f"{link_prefix}dc", "m"
    core = EngineCore(model, runner, redis_url, link_prefix=prefix, engine_id="live")
    r = redis.Redis.from_url(redis_url)
    now_ms = int(time.time() * 1000)
    routing = routing_key(prefix, model)
    for eid, expired_ago_ms in (("gone", DEAD_STREAM_DROP_MS + 5_000), ("recent", 5_000)):
        r.zadd(replicas_index_key(prefix, model), {eid: now_ms - expired_ago_ms})
        r.xgroup_create(replica_requests_stream(prefix, model, eid), ENGINE_GROUP, id="0", mkstream=True)
        r.sadd(replica_blocks_key(prefix, model, eid), b"x" * 16)
        r.hset(routing, mapping={f"requests:{eid}": 7, f"hit_tokens:{eid}": 64})
    r.hset(routing, mapping={"requests:live": 3, "resent": 2})

    assert core._take_over(8) == {}  # nothing queued in either stream: nothing taken

    assert not r.exists(replica_requests_stream(prefix, model, "gone"), replica_blocks_key(prefix, model, "gone"))
    # the recently dead replica keeps its stream (a request may still be taken from it) and its counts
    assert r.exists(replica_requests_stream(prefix, model, "recent"), replica_blocks_key(prefix, model, "recent")) == 2
    assert r.hgetall(routing) == {b"requests:recent": b"7", b"hit_tokens:recent": b"64", b"requests:live": b"3",
                                  b"resent": b"2"}
