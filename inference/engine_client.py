"""Api-side end of the engine link (DESIGN.md §6): send requests, read batched outputs, abort, watch replicas.

One ``EngineLink`` per api process (``EngineLink.for_current_process``), bound to that process's asyncio
loop. It owns:

* one reader task that ``XREAD``s the process's output stream (one message per engine step per process,
  see ``inference.protocol.engine``) and dispatches each ``EngineCoreOutput`` to the per-request queue;
* one watchdog task that, every ``WATCHDOG_INTERVAL_S``, fails requests whose replica stopped heart-beating
  (or, before any replica accepted them, when no replica of the model is alive for ``ACCEPT_GRACE_S``),
  and refreshes this process's own liveness key so engines can drop requests of a dead api process.

The per-request queue is registered before the request is sent (DESIGN.md §2 step 8), so no output can
be lost between sending and listening.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import msgpack
import redis.asyncio as aioredis

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
    replicas_index_key,
    requests_stream,
)
from inference.redis_timeouts import blocking_socket_timeout

log = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 1.0
# add_requests trusts a replica it saw alive this recently (s) without asking Redis again; a replica that dies
# inside the window is caught like one that dies after the check (watchdog, ACCEPT_GRACE_S)
REPLICA_CHECK_TTL_S = 0.5
ACCEPT_GRACE_S = 5.0
# the reader's XREAD blocks this long (ms); the link's pool waits longer for any reply (redis_timeouts.py)
READ_BLOCK_MS = 1000

class EngineUnavailableError(RuntimeError):
    """No live engine replica serves the model (maps to HTTP 503)."""


@dataclass
class _Tracked:
    model: str
    queue: asyncio.Queue[EngineCoreOutput]
    sent_at: float
    engine_id: str | None = None
    done: bool = False


@dataclass
class EngineLink:
    """Api-process side of the Redis engine link. Create with ``EngineLink.for_current_process``."""

    redis: aioredis.Redis
    prefix: str
    client_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    _tracked: dict[str, _Tracked] = field(default_factory=dict)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _replicas_seen: dict[str, float] = field(default_factory=dict)  # model -> monotonic time a replica was seen
    _alive_set_at: float = -1e9

    _instances: ClassVar[dict[int, EngineLink]] = {}

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

    # ----------------------------------------------------------------- replicas
    async def live_replicas(self, model: str) -> list[EngineStats]:
        """Heartbeats of the live replicas of ``model`` (empty list when none)."""
        ids = await self.redis.zrangebyscore(replicas_index_key(self.prefix, model), int(time.time() * 1000), "+inf")
        if not ids:
            return []
        values = await self.redis.mget(live_replica_keys(ids, self.prefix, model))
        return [EngineStats.from_wire(cast(bytes, v)) for v in values if v]  # a bytes-mode pool

    # ----------------------------------------------------------------- requests
    async def add_requests(self, model: str, requests: list[EngineCoreRequest],
                           queue: asyncio.Queue[EngineCoreOutput] | None = None) -> dict[str, asyncio.Queue[EngineCoreOutput]]:
        """Register an output queue per request, then send them all to ``model``'s request stream.

        Returns ``{request_id: queue}``; each queue yields ``EngineCoreOutput`` until one with a
        ``finish_reason``. Pass ``queue`` to have all the requests (``n`` children of one API request)
        share one queue. Raises ``EngineUnavailableError`` when no replica of ``model`` is alive.
        """
        now = time.monotonic()
        if now - self._replicas_seen.get(model, -1e9) > REPLICA_CHECK_TTL_S:
            if not await self.live_replicas(model):
                self._replicas_seen.pop(model, None)
                raise EngineUnavailableError(f"No engine replica is serving model '{model}' right now")
            self._replicas_seen[model] = now
        if now - self._alive_set_at > API_ALIVE_TTL_S / 4:
            await self._ensure_alive_key()
        queues: dict[str, asyncio.Queue[EngineCoreOutput]] = {}
        for req in requests:
            q: asyncio.Queue[EngineCoreOutput] = queue if queue is not None else asyncio.Queue()
            self._tracked[req.request_id] = _Tracked(model=model, queue=q, sent_at=now)
            queues[req.request_id] = q
        try:
            # MULTI/EXEC: Redis serves a replica blocked in XREADGROUP only after the whole block, so it
            # reads all of them in one go and batches them (n children, the inputs of one embeddings call).
            # A plain pipeline woke it at the first XADD: one forward for 1 input, another for the rest
            # (32 inputs: 99 ms instead of ~75).
            entries = pack_requests(requests)  # n children of one request: one entry, shared fields once
            async with self.redis.pipeline(transaction=len(entries) > 1) as pipe:
                for entry in entries:
                    pipe.xadd(requests_stream(self.prefix, model), cast(dict[Any, Any], entry))  # str -> bytes fields
                await pipe.execute()
        except BaseException:
            for req in requests:
                self._tracked.pop(req.request_id, None)
            raise
        return queues

    async def abort(self, model: str, request_ids: list[str]) -> None:
        """Ask every replica of ``model`` to abort ``request_ids`` and stop tracking them."""
        live = [rid for rid in request_ids if rid in self._tracked]
        for rid in request_ids:
            self._tracked.pop(rid, None)
        if live:
            await self.redis.xadd(control_stream(self.prefix, model), {"a": msgpack.packb(live)},
                                  maxlen=10000, approximate=True)

    def release(self, request_id: str) -> None:
        """Stop tracking a finished request (idempotent)."""
        self._tracked.pop(request_id, None)

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
        tracked.queue.put_nowait(out)
        if out.finish_reason is not None:
            self._tracked.pop(out.request_id, None)

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
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            tracked.queue.put_nowait(EngineCoreOutput(request_id=request_id, finish_reason=FINISH_ERROR,
                                                      error=message))

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
        unaccepted: dict[str, list[str]] = {}
        for rid, t in list(self._tracked.items()):
            if t.engine_id:
                by_engine.setdefault((t.model, t.engine_id), []).append(rid)
            elif now - t.sent_at > ACCEPT_GRACE_S:
                unaccepted.setdefault(t.model, []).append(rid)
        if by_engine:
            keys = [replica_key(self.prefix, m, e) for (m, e) in by_engine]
            alive = await self.redis.mget(keys)
            for (m, e), value in zip(by_engine, alive):
                if not value:
                    for rid in by_engine[(m, e)]:
                        self._fail(rid, f"The engine replica '{e}' serving model '{m}' stopped responding")
        for model, rids in unaccepted.items():
            if not await self.live_replicas(model):
                for rid in rids:
                    self._fail(rid, f"No engine replica is serving model '{model}'")
