"""Api-side end of the engine link (docs/ARCHITECTURE.md §6): send requests, read batched outputs, abort, watch
replicas.

One ``EngineLink`` per api process (``EngineLink.for_current_process``), bound to that process's asyncio
loop. It owns:

* one reader task that ``XREAD``s the process's output stream (one message per engine step per process,
  see ``inference.protocol.engine``) and dispatches each ``EngineCoreOutput`` to the per-request queue;
* one watchdog task that, every ``WATCHDOG_INTERVAL_S``, handles requests whose replica stopped heart-beating:
  one that has produced nothing yet (accepted, still waiting there) is sent again to a live replica under a new
  internal id (``MAX_RESENDS`` times at most; its outputs still reach the caller under the id it knows), the others
  fail; it also fails requests no replica accepted when no replica of the model is alive for ``ACCEPT_GRACE_S``, or
  when the replica they were routed to died and no other took them over within ``RECLAIM_GRACE_S``, and refreshes
  this process's own liveness key so engines can drop requests of a dead api process.

Routing (``ENGINE_ROUTING``, default ``prefix``; ``ReplicaRouter``, the link's ``router``): a generate request goes
to the request stream of the replica ``inference.api.router`` chooses from the prompt's prefix-cache block hashes and the replicas' load (this process's
own in-flight requests and the replicas' heartbeats and stream lengths); pooling (embeddings) requests, and
every request with ``ENGINE_ROUTING=shared``, go to the model's shared stream, which any replica pulls from.

The per-request queue is registered before the request is sent (docs/ARCHITECTURE.md §2 step 9), so no output can
be lost between sending and listening.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import msgpack
import redis.asyncio as aioredis

from inference.shared.config import SETTINGS
from inference.shared.prefix_hash import BLOCK_SIZE, block_hashes
from inference.protocol.engine import (
    API_ALIVE_TTL_S,
    api_alive_key,
    FINISH_ERROR,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    control_stream,
    outputs_stream,
    replica_key,
    live_replica_keys,
    pack_requests,
    replica_blocks_key,
    replica_requests_stream,
    replicas_index_key,
    requests_stream,
    routing_key,
)
from inference.api.router import ReplicaView, choose_replica, hit_tokens, request_cost_tokens, with_expected_hit
from inference.shared.redis_timeouts import blocking_socket_timeout

log = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 1.0
# add_requests trusts a replica it saw alive this recently (s) without asking Redis again; a replica that dies
# inside the window is caught like one that dies after the check (watchdog, ACCEPT_GRACE_S)
REPLICA_CHECK_TTL_S = 0.5
ACCEPT_GRACE_S = 5.0
# a request routed to a replica that died unread is taken over by a live replica within ~1 s (engine/replica_link.py
# ``_reclaim``); one still unaccepted this long after the death was seen fails (and is aborted everywhere)
RECLAIM_GRACE_S = 10.0
# times a request accepted by a replica that died before producing anything is sent again (then it fails)
MAX_RESENDS = 2
ROUTING_PREFIX, ROUTING_SHARED = "prefix", "shared"
# the reader's XREAD blocks this long (ms); the link's pool waits longer for any reply (redis_timeouts.py)
READ_BLOCK_MS = 1000

def resend_id(caller_id: str, attempt: int) -> str:
    """The internal id of the ``attempt``-th re-send (1 .. ``MAX_RESENDS``) of the request its caller knows as
    ``caller_id`` (``EngineLink._resend``)."""
    return f"{caller_id}~r{attempt}"


@dataclass(frozen=True)
class ExpectedHit:
    """The replica ``engine_id`` is expected to hold the first ``tokens`` prompt tokens of the requests sent in this
    context (``EXPECTED_HIT``; ``inference.api.router.with_expected_hit``)."""

    engine_id: str
    tokens: int


EXPECTED_HIT: ContextVar[ExpectedHit | None] = ContextVar("expected_hit", default=None)
"""Set by a route around its hand-off when it knows where a prompt's prefix is cached (a stored conversation's
parent replica, ``gateway/endpoints/responses.py``); read by ``ReplicaRouter`` when it routes by prefix."""


class EngineUnavailableError(RuntimeError):
    """No live engine replica serves the model (maps to HTTP 503)."""


@dataclass
class _Tracked:
    model: str
    queue: asyncio.Queue[EngineCoreOutput]
    sent_at: float
    engine_id: str | None = None
    done: bool = False
    target: str | None = None  # the replica it was routed to (None: the shared stream)
    entries: tuple[str, list[Any]] | None = None  # (stream, entry ids) that carried it: deleted if it is failed unread
    pending_tokens: int = 0  # prompt tokens counted in the target's load until the first token (or the end)
    request: EngineCoreRequest | None = None  # what was sent, kept until it produced something (for a re-send)
    alias: str | None = None  # the id the caller knows, when it was re-sent under another
    resends: int = 0


@dataclass
class _Load:
    """This process's requests on one replica: unfinished ones, and prompt tokens of those without a first token."""

    requests: int = 0
    tokens: int = 0


@dataclass
class ReplicaRouter:
    """Which replica of a model gets a request, for one api process: the live replicas (their heartbeats, seen at
    most ``REPLICA_CHECK_TTL_S`` ago), this process's own load on each (requests unfinished, prompt tokens without a
    first token) and ``inference.api.router``'s choice over both. ``routing``: ``prefix`` (route generate requests by
    prefix-cache hits and load) or ``shared`` (everything to the model's shared stream); ``request_cost_tokens``: the
    router's weight of a request (None: from the replicas' measured throughputs)."""

    redis: aioredis.Redis
    prefix: str
    routing: str = SETTINGS.engine_routing
    request_cost_tokens: float | None = None
    _replicas: dict[str, tuple[float, list[EngineStats]]] = field(default_factory=dict)  # model -> (seen at, live)
    _load: dict[tuple[str, str], _Load] = field(default_factory=dict)  # (model, engine id) -> this process's load

    async def live_replicas(self, model: str) -> list[EngineStats]:
        """Heartbeats of the live replicas of ``model`` (empty list when none)."""
        ids = await self.redis.zrangebyscore(replicas_index_key(self.prefix, model), int(time.time() * 1000), "+inf")
        if not ids:
            return []
        values = await self.redis.mget(live_replica_keys(ids, self.prefix, model))
        return [EngineStats.from_wire(cast(bytes, v)) for v in values if v]  # a bytes-mode pool

    async def live(self, model: str) -> list[EngineStats]:
        """The live replicas of ``model``, as seen at most ``REPLICA_CHECK_TTL_S`` ago (a replica the watchdog saw
        die is dropped at once: ``forget``). Raises ``EngineUnavailableError`` when there is none."""
        now = time.monotonic()
        seen = self._replicas.get(model)
        if seen is None or now - seen[0] > REPLICA_CHECK_TTL_S:
            seen = (now, await self.live_replicas(model))
            self._replicas[model] = seen
        if not seen[1]:
            self._replicas.pop(model, None)
            raise EngineUnavailableError(f"No engine replica is serving model '{model}' right now")
        return seen[1]

    def forget(self, model: str) -> None:
        """Ask Redis again for ``model``'s live replicas on the next ``live`` (one of them was seen dead)."""
        self._replicas.pop(model, None)

    async def target(self, model: str, requests: list[EngineCoreRequest],
                     replicas: list[EngineStats]) -> tuple[str | None, int]:
        """``(engine id, expected cached prompt tokens)`` of the replica ``requests`` (children of one prompt) go to:
        the router's pick with ``prefix`` routing for generate requests, else ``(None, 0)``, the model's shared
        stream."""
        if self.routing == ROUTING_PREFIX and requests and not requests[0].pooling:
            return await self._route(model, requests[0], replicas)
        return None, 0

    async def _route(self, model: str, req: EngineCoreRequest, replicas: list[EngineStats]) -> tuple[str, int]:
        """``(engine id, expected cached prompt tokens)`` of the replica ``inference.api.router`` picks for ``req``.

        One round trip: each replica's stream length and, for a prompt of at least one full block, which of the
        prompt's block hashes its published set holds. A prompt with images is chosen by load alone (its block
        hashes carry the images' keys at positions only the engine knows)."""
        prompt = req.prompt_token_ids
        hashes = [] if req.mm_cache_keys else block_hashes(prompt, block_size=BLOCK_SIZE, cache_salt=req.cache_salt)
        async with self.redis.pipeline(transaction=False) as pipe:
            for st in replicas:
                pipe.xlen(replica_requests_stream(self.prefix, model, st.engine_id))
                if hashes:
                    pipe.smismember(replica_blocks_key(self.prefix, model, st.engine_id), hashes)
            replies = await pipe.execute()
        step = 2 if hashes else 1
        views = []
        for i, st in enumerate(replicas):
            mine = self._load.get((model, st.engine_id)) or _Load()
            queued = int(replies[i * step])
            views.append(ReplicaView(
                engine_id=st.engine_id,
                hit_tokens=hit_tokens(replies[i * step + 1], BLOCK_SIZE) if hashes else 0,
                queued_tokens=max(mine.tokens, st.num_waiting_tokens),
                num_requests=max(mine.requests, st.num_running + st.num_waiting + queued)))
        expected = EXPECTED_HIT.get()
        if expected is not None:
            views = with_expected_hit(views, expected.engine_id, min(expected.tokens, len(prompt)))
        weight = self.request_cost_tokens
        if weight is None:
            weight = request_cost_tokens([(st.prefill_tokens_per_s, st.decode_tokens_per_s) for st in replicas])
        best = choose_replica(len(prompt), views, request_cost_tokens=weight)
        return best.engine_id, best.hit_tokens

    def load(self, tracked: _Tracked, prompt_tokens: int, hit: int) -> None:
        """Count ``tracked`` (sent to ``tracked.target`` with ``prompt_tokens`` of which ``hit`` are expected cached)
        in its target's load until its first token (its tokens) and its end (the request)."""
        tracked.pending_tokens = max(prompt_tokens - hit, 1)
        load = self._load.setdefault((tracked.model, tracked.target or ""), _Load())
        load.requests += 1
        load.tokens += tracked.pending_tokens

    def unload(self, tracked: _Tracked, *, finished: bool) -> None:
        """Take ``tracked``'s queued prompt tokens (and, when ``finished``, the request) off its target's load."""
        key = (tracked.model, tracked.target or "")
        load = self._load.get(key)
        if load is None:
            return
        load.tokens -= tracked.pending_tokens
        tracked.pending_tokens = 0
        if finished:
            load.requests -= 1
            tracked.target = None
        if load.requests <= 0:
            del self._load[key]


@dataclass
class EngineLink:
    """Api-process side of the Redis engine link. Create with ``EngineLink.for_current_process``. Which replica gets
    a request is its ``router``'s job (``ReplicaRouter``; ``routing`` and ``request_cost_tokens`` are the router's)."""

    redis: aioredis.Redis
    prefix: str
    client_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    _tracked: dict[str, _Tracked] = field(default_factory=dict)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    router: ReplicaRouter = field(init=False)
    _dead_since: dict[tuple[str, str], float] = field(default_factory=dict)  # routed-to replicas seen dead
    _resent: dict[str, str] = field(default_factory=dict)  # the caller's request id -> the id it was re-sent as
    _aborting: set[asyncio.Task[None]] = field(default_factory=set)  # aborts after failed sends (``_abort_later``)
    _alive_set_at: float = -1e9

    _instances: ClassVar[dict[int, EngineLink]] = {}

    def __post_init__(self) -> None:
        self.router = ReplicaRouter(self.redis, self.prefix)

    @property
    def routing(self) -> str:
        """``ROUTING_PREFIX`` or ``ROUTING_SHARED`` (``ReplicaRouter.routing``; settable)."""
        return self.router.routing

    @routing.setter
    def routing(self, value: str) -> None:
        self.router.routing = value

    @property
    def request_cost_tokens(self) -> float | None:
        """The router's weight of a request (``ReplicaRouter.request_cost_tokens``; settable)."""
        return self.router.request_cost_tokens

    @request_cost_tokens.setter
    def request_cost_tokens(self, value: float | None) -> None:
        self.router.request_cost_tokens = value

    @classmethod
    def for_current_process(cls, redis_url: str, prefix: str) -> EngineLink:
        """The process's link for the running event loop (created and started on first use)."""
        loop = asyncio.get_running_loop()
        link = cls._instances.get(id(loop))
        if link is None or link._loop is not loop:
            link = cls(redis=aioredis.Redis.from_url(redis_url, max_connections=256,
                                                     socket_timeout=blocking_socket_timeout(READ_BLOCK_MS / 1000)),
                       prefix=prefix)
            link._start(loop)
            cls._instances[id(loop)] = link
        return link

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._tasks.append(loop.create_task(self._reader(), name="engine-link-reader"))
        self._tasks.append(loop.create_task(self._watchdog(), name="engine-link-watchdog"))

    async def close(self) -> None:
        """Stop the reader and watchdog tasks and drop this process's output stream."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing: a reader's own failure is moot
                pass
        try:
            await self.redis.delete(outputs_stream(self.prefix, self.client_id),
                                    api_alive_key(self.prefix, self.client_id))
        finally:
            await self.redis.aclose()

    async def live_replicas(self, model: str) -> list[EngineStats]:
        """Heartbeats of the live replicas of ``model`` (``ReplicaRouter.live_replicas``)."""
        return await self.router.live_replicas(model)

    # ----------------------------------------------------------------- requests
    async def add_requests(self, model: str, requests: list[EngineCoreRequest],
                           queue: asyncio.Queue[EngineCoreOutput] | None = None) -> dict[str, asyncio.Queue[EngineCoreOutput]]:
        """Register an output queue per request, then send them all to one replica of ``model``: the one the
        router picks (``ENGINE_ROUTING=prefix``, generate requests), else the model's shared request stream.

        Returns ``{request_id: queue}``; each queue yields ``EngineCoreOutput`` until one with a
        ``finish_reason``. Pass ``queue`` to have all the requests (``n`` children of one API request)
        share one queue; they all go to the same replica. Raises ``EngineUnavailableError`` when no replica
        of ``model`` is alive.
        """
        replicas = await self.router.live(model)
        if time.monotonic() - self._alive_set_at > API_ALIVE_TTL_S / 4:
            await self._ensure_alive_key()
        queues: dict[str, asyncio.Queue[EngineCoreOutput]] = {}
        tracked: list[_Tracked] = []
        for req in requests:
            q: asyncio.Queue[EngineCoreOutput] = queue if queue is not None else asyncio.Queue()
            t = _Tracked(model=model, queue=q, sent_at=time.monotonic(), request=req)
            self._tracked[req.request_id] = t
            queues[req.request_id] = q
            tracked.append(t)
        await self._send(model, requests, tracked, replicas)
        return queues

    async def _send(self, model: str, requests: list[EngineCoreRequest], tracked: list[_Tracked],
                    replicas: list[EngineStats]) -> None:
        """Send ``requests`` (tracked as ``tracked``, in the same order) to one replica of ``model``, routed as
        ``add_requests`` says; on a failure to send, they are no longer tracked and the error is raised."""
        target, hit = await self.router.target(model, requests, replicas)
        for req, t in zip(requests, tracked):
            t.target = target
            if target is not None:
                self.router.load(t, len(req.prompt_token_ids), hit)
        stream = requests_stream(self.prefix, model) if target is None else \
            replica_requests_stream(self.prefix, model, target)
        try:
            # MULTI/EXEC: Redis serves a replica blocked in XREADGROUP only after the whole block, so it
            # reads all of them in one go and batches them (n children, the inputs of one embeddings call).
            # A plain pipeline woke it at the first XADD: one forward for 1 input, another for the rest
            # (32 inputs: 99 ms instead of ~75).
            entries = pack_requests(requests)  # n children of one request: one entry, shared fields once
            async with self.redis.pipeline(transaction=len(entries) > 1) as pipe:
                for entry in entries:
                    pipe.xadd(stream, cast(dict[Any, Any], entry))  # str -> bytes fields
                if target is not None:  # counts for /metrics, in the same round trip
                    pipe.hincrby(routing_key(self.prefix, model), f"requests:{target}", len(requests))
                    if hit:
                        pipe.hincrby(routing_key(self.prefix, model), f"hit_tokens:{target}", hit * len(requests))
                replies = await pipe.execute()
        except BaseException:
            for req in requests:
                self._untrack(req.request_id)
            # The entries may be in the stream already: a cancellation (the client went away) or a timeout that
            # came while the reply was on its way. Abort them, or a replica runs them to max_tokens for nobody.
            self._abort_later(model, [req.request_id for req in requests])
            raise
        sent = (stream, list(replies[:len(entries)]))
        for t in tracked:
            t.entries = sent

    async def _resend(self, request_id: str) -> bool:
        """Send the request tracked as ``request_id``, accepted by a replica that died before it produced anything
        (it was waiting there), again to a live replica, under a new internal id; the caller keeps reading it under
        the id it knows (``_deliver``, ``abort``). The old id is aborted everywhere (a replica that only seemed dead
        drops it). False, doing nothing, when it cannot be: it produced something already, was re-sent
        ``MAX_RESENDS`` times, or no replica of its model is alive."""
        t = self._tracked.get(request_id)
        if t is None or t.request is None or t.resends >= MAX_RESENDS:
            return False
        try:
            replicas = await self.router.live(t.model)
        except EngineUnavailableError:
            return False
        if self._tracked.get(request_id) is not t or t.request is None:  # finished or aborted meanwhile
            return False
        caller_id = t.alias or request_id
        req = dataclasses.replace(t.request, request_id=resend_id(caller_id, t.resends + 1))
        del self._tracked[request_id]
        if t.target is not None:
            self.router.unload(t, finished=True)
        t.alias, t.request, t.engine_id, t.entries = caller_id, req, None, None
        t.resends += 1
        t.sent_at = time.monotonic()
        self._tracked[req.request_id] = t
        self._resent[caller_id] = req.request_id
        log.warning("re-sending request %s (waiting on replica that died) as %s", caller_id, req.request_id)
        try:
            await self._send(t.model, [req], [t], replicas)  # untracks it when the send fails
        except Exception as exc:  # noqa: BLE001 - the caller gets the error, the watchdog goes on
            t.queue.put_nowait(EngineCoreOutput(request_id=caller_id, finish_reason=FINISH_ERROR,
                                                error=f"The engine replica serving model '{t.model}' stopped "
                                                      f"responding, and sending the request again failed: {exc}"))
        else:  # counted for /metrics (``engine_resent_requests``, per model: a dead replica's own series would be
            # born at its final value, which Prometheus' increase() does not count)
            await self.redis.hincrby(routing_key(self.prefix, t.model), "resent", 1)
        await self._send_abort(t.model, [request_id])
        return True

    async def abort(self, model: str, request_ids: list[str]) -> None:
        """Ask every replica of ``model`` to abort ``request_ids`` and stop tracking them. Also ids no longer
        tracked: a child whose stop string matched is aborted from a task of its own (``GenerationRun.deltas``),
        which may run after the handler released it; without the abort its replica decodes on to ``max_tokens``."""
        request_ids = [self._resent.get(rid, rid) for rid in request_ids]
        for rid in request_ids:
            self._untrack(rid)
        if request_ids:
            await self._send_abort(model, request_ids)

    async def abort_in_engines(self, model: str, request_ids: list[str]) -> None:
        """Ask every replica of ``model`` to abort ``request_ids``, sent by this or another api process, and leave
        them tracked: each one's replica ends it with an ``abort`` output, which reaches its caller (the generate
        route's ``/abort_requests`` may run in another api process than the request). An id this process re-sent
        goes under its new id; an id it does not track goes with the ids a re-send would have given it
        (``resend_id``): only the process that sent it knows whether it was re-sent, and an abort of an id no
        replica has is harmless (kept ``EARLY_ABORT_S`` by the replicas, so a re-send after it is dropped too)."""
        ids: list[str] = []
        for rid in request_ids:
            if rid in self._resent or rid in self._tracked:
                ids.append(self._resent.get(rid, rid))
            else:
                ids.extend([rid, *(resend_id(rid, n) for n in range(1, MAX_RESENDS + 1))])
        if ids:
            await self._send_abort(model, ids)

    def _abort_later(self, model: str, request_ids: list[str]) -> None:
        """Abort ``request_ids`` from a task of its own (the caller may be a cancelled task); a failure is logged.
        An abort of an id no replica has read yet is kept by the replicas for ``EARLY_ABORT_S`` (engine/base_scheduler.py)."""
        async def abort() -> None:
            try:
                await self._send_abort(model, request_ids)
            except Exception as exc:  # noqa: BLE001 - Redis down: the entries' send most likely failed as well
                log.warning("abort of %s after a failed send failed: %s", request_ids, exc)

        task = asyncio.get_running_loop().create_task(abort())
        self._aborting.add(task)
        task.add_done_callback(self._aborting.discard)

    async def _send_abort(self, model: str, request_ids: list[str]) -> None:
        await self.redis.xadd(control_stream(self.prefix, model), {"a": msgpack.packb(request_ids)},
                              maxlen=10000, approximate=True)

    def release(self, request_id: str) -> None:
        """Stop tracking a finished request (idempotent)."""
        self._untrack(request_id)

    def _untrack(self, request_id: str) -> _Tracked | None:
        """Stop tracking ``request_id`` (the caller's id or the one it was re-sent as) and take it off its replica's
        load; the entry, or None if untracked."""
        tracked = self._tracked.pop(self._resent.get(request_id, request_id), None)
        if tracked is not None:
            if tracked.alias is not None:
                self._resent.pop(tracked.alias, None)
            if tracked.target is not None:
                self.router.unload(tracked, finished=True)
        return tracked

    @property
    def num_tracked(self) -> int:
        """Requests this process is waiting on (for tests and metrics)."""
        return len(self._tracked)

    # ----------------------------------------------------------------- tasks
    async def _ensure_alive_key(self) -> None:
        self._alive_set_at = time.monotonic()
        await self.redis.set(api_alive_key(self.prefix, self.client_id), b"1", ex=API_ALIVE_TTL_S)

    def _deliver(self, out: EngineCoreOutput) -> None:
        tracked = self._tracked.get(out.request_id)
        if tracked is None:
            return
        if out.engine_id:
            tracked.engine_id = out.engine_id
        if tracked.request is not None and (out.new_token_ids or out.finish_reason is not None
                                            or out.prompt_logprobs is not None or out.pooled is not None):
            tracked.request = None  # it produced something: a re-send would repeat it
        if tracked.alias is not None:
            out.request_id = tracked.alias
        tracked.queue.put_nowait(out)
        if out.finish_reason is not None:
            self._untrack(out.request_id)
        elif tracked.pending_tokens and out.new_token_ids:
            self.router.unload(tracked, finished=False)

    async def _reader(self) -> None:
        key = outputs_stream(self.prefix, self.client_id)
        last_id = "0-0"
        read_ids: list[bytes] = []
        while True:
            try:
                if read_ids:
                    # the entries already delivered are deleted in the same round trip as the next read
                    async with self.redis.pipeline(transaction=False) as pipe:
                        pipe.xdel(key, *read_ids)
                        pipe.xread({key: last_id}, block=READ_BLOCK_MS, count=512)
                        _deleted, resp = await pipe.execute()
                    read_ids = []
                else:
                    resp = await self.redis.xread({key: last_id}, block=READ_BLOCK_MS, count=512)
                if not resp:
                    continue
                ids = read_ids
                for _stream, entries in resp:
                    for entry_id, fields in entries:
                        last_id = entry_id
                        ids.append(entry_id)
                        batch = EngineCoreOutputs.from_wire(fields[b"o"])
                        for out in batch.outputs:
                            out.engine_id = out.engine_id or batch.engine_id
                            self._deliver(out)
            except asyncio.CancelledError:
                raise
            except Exception:  # the reader must survive a Redis hiccup
                log.exception("engine link reader error; retrying")
                await asyncio.sleep(0.2)

    def _fail(self, request_id: str, message: str) -> None:
        tracked = self._untrack(request_id)
        if tracked is not None:
            tracked.queue.put_nowait(EngineCoreOutput(request_id=tracked.alias or request_id,
                                                      finish_reason=FINISH_ERROR, error=message))

    async def _fail_unread(self, model: str, request_ids: list[str], message: str) -> None:
        """Fail requests no replica accepted, delete their stream entries (a replica started or taking over later
        must not run them for nobody) and abort them (one that read them meanwhile drops them)."""
        if not request_ids:
            return
        unread: dict[str, set[Any]] = {}
        for rid in request_ids:
            tracked = self._tracked.get(rid)
            if tracked is not None and tracked.entries is not None:
                unread.setdefault(tracked.entries[0], set()).update(tracked.entries[1])
            self._fail(rid, message)
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream, ids in unread.items():
                pipe.xdel(stream, *ids)
            await pipe.execute()
        await self._send_abort(model, request_ids)

    async def _watchdog(self) -> None:
        while True:
            try:
                await asyncio.sleep(WATCHDOG_INTERVAL_S)
                if self._tracked:
                    await self._ensure_alive_key()
                    await self._check_replicas()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("engine link watchdog error")

    async def _check_replicas(self) -> None:
        now = time.monotonic()
        by_engine: dict[tuple[str, str], list[str]] = {}
        routed: dict[tuple[str, str], list[str]] = {}  # unaccepted, sent to one replica's stream
        unaccepted: dict[str, list[str]] = {}
        for rid, t in list(self._tracked.items()):
            if t.engine_id:
                by_engine.setdefault((t.model, t.engine_id), []).append(rid)
            else:
                if t.target:
                    routed.setdefault((t.model, t.target), []).append(rid)
                if now - t.sent_at > ACCEPT_GRACE_S:
                    unaccepted.setdefault(t.model, []).append(rid)
        watched = list(dict.fromkeys([*by_engine, *routed]))
        alive = dict(zip(watched, await self.redis.mget([replica_key(self.prefix, m, e) for (m, e) in watched])
                         if watched else []))
        for (m, e), value in alive.items():
            if value:
                self._dead_since.pop((m, e), None)
                continue
            self._dead_since.setdefault((m, e), now)
            self.router.forget(m)  # out of the choice at once, not after REPLICA_CHECK_TTL_S
            for rid in by_engine.get((m, e), []):
                if not await self._resend(rid):
                    self._fail(rid, f"The engine replica '{e}' serving model '{m}' stopped responding")
        stranded: dict[str, list[str]] = {}
        for (m, e), rids in routed.items():
            if now - self._dead_since.get((m, e), now) > RECLAIM_GRACE_S:
                stranded.setdefault(m, []).extend(r for r in rids if r in self._tracked)
        for m, rids in stranded.items():
            if rids:  # no live replica took them over: fail them, and abort them wherever they may still run
                await self._fail_unread(m, rids, f"The engine replica serving model '{m}' stopped before starting "
                                                 "this request")
        for model, rids in unaccepted.items():
            if not await self.router.live_replicas(model):
                await self._fail_unread(model, [r for r in rids if r in self._tracked],
                                        f"No engine replica is serving model '{model}'")
        for key in [k for k in self._dead_since if k not in alive]:
            del self._dead_since[key]
