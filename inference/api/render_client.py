"""Await Celery render/tokenize tasks from an asyncio loop without holding a thread per waiting request.

Celery's ``AsyncResult.get`` blocks a thread while it waits, and its Redis result backend costs a result
write, a Pub/Sub subscription per task in the sending process and a result key per request. Instead, each
api process (event loop) subscribes once to its own reply channel; a task is sent with ``ignore_result`` and
the channel name plus a reply id in its payload, and the worker publishes the task's return value there
(``inference.workers.tasks.reply_if_requested``). One Pub/Sub connection per process serves any number of waiting requests
(docs/ARCHITECTURE.md §2, "nothing slow on the event loop": no thread held per waiting request). On a Redis broker the
task message (Celery's own, ``inference.api.celery_publish``) is pushed from the loop with its asyncio client; on any
other broker ``send_task`` runs on a small thread pool, because kombu's producer is synchronous.

This is the one piece here that a library should have provided; Celery has no asyncio result API.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from inference.api.celery_publish import RedisTaskPublisher
from inference.protocol.render import RENDER_QUEUE, RenderFailure, RenderTask, ResultT
from inference.api.render_liveness import NO_WORKER_SEEN, RenderWorkersState, remaining_wait, workers_state

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger(__name__)


class RenderUnavailableError(RuntimeError):
    """No worker of ``queue`` (``render`` or ``mm``) answered in time (maps to HTTP 503)."""

    def __init__(self, message: str, queue: str = RENDER_QUEUE):
        super().__init__(message)
        self.queue = queue


_expires_cache: tuple[int, float, str] = (0, 0.0, "")


def expires_at(after_s: float) -> str:
    """Celery's ``expires`` for a task nobody waits for after ``after_s`` seconds: an ISO 8601 UTC time 2-3 s past
    it (whole seconds, reused for a second: Celery would otherwise build an aware datetime per publish, ~0.1 ms
    of the api's CPU measured on the 2-core box)."""
    global _expires_cache
    second, after, text = _expires_cache
    now = int(time.time())
    if now != second or after != after_s:
        text = datetime.fromtimestamp(now + math.ceil(after_s) + 2, tz=timezone.utc).isoformat()
        _expires_cache = (now, after_s, text)
    return text


def parse_reply(data: bytes | str) -> Any:
    """A worker's reply message (``inference.workers.tasks.reply_json``) as Python values: orjson (a ~1,000-id render reply
    ~10x faster than the standard library; 8 % of the api's CPU samples under a ``/tokenize`` load went to
    ``json.loads`` here), else the standard library for what orjson refuses (integers past 64 bits, lone surrogate
    escapes, which the worker writes with ``json.dumps``). Raises ``ValueError`` for text that is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


class RenderReplyWaiter:
    """One reply channel and Pub/Sub connection per event loop; resolves futures keyed by reply id."""

    _instances: ClassVar[dict[int, RenderReplyWaiter]] = {}
    _publish_pool: ClassVar[ThreadPoolExecutor | None] = None

    def __init__(self, redis_url: str, prefix: str):
        self.prefix = prefix
        self._redis = aioredis.Redis.from_url(redis_url)
        self._pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        self.channel = f"{prefix}:render:reply:{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._futures: dict[str, asyncio.Future[Any]] = {}
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._publishers: dict[int, tuple[Celery, RedisTaskPublisher | None]] = {}

    def _publisher(self, app: Celery) -> RedisTaskPublisher | None:
        """This loop's direct publisher for ``app``'s broker (``None``: not Redis, ``send_task`` it is)."""
        entry = self._publishers.get(id(app))
        if entry is None or entry[0] is not app:
            entry = self._publishers[id(app)] = (app, RedisTaskPublisher.for_app(app))
        return entry[1]

    @classmethod
    def for_current_loop(cls, redis_url: str, prefix: str) -> RenderReplyWaiter:
        """The waiter bound to the running loop (created on first use)."""
        loop = asyncio.get_running_loop()
        waiter = cls._instances.get(id(loop))
        if waiter is None:
            waiter = cls(redis_url, prefix)
            cls._instances[id(loop)] = waiter
        return waiter

    @classmethod
    def _pool(cls) -> ThreadPoolExecutor:
        if cls._publish_pool is None:
            cls._publish_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="celery-publish")
        return cls._publish_pool

    async def _ensure_listening(self) -> None:
        if self._task is not None and not self._task.done():
            return
        async with self._lock:
            if self._task is not None and not self._task.done():
                return
            await self._pubsub.subscribe(self.channel)
            self._task = asyncio.get_running_loop().create_task(self._listen(), name="render-replies")

    async def _listen(self) -> None:
        while True:
            try:
                msg = await self._pubsub.get_message(timeout=1.0)
                if msg is None or msg.get("type") != "message":
                    continue
                reply = parse_reply(msg["data"])
                fut = self._futures.get(reply.get("id"))
                if fut is not None and not fut.done():
                    fut.set_result(reply.get("result"))
            except asyncio.CancelledError:
                raise
            except Exception:  # keep listening after a hiccup (redis-py resubscribes)
                log.exception("render reply listener error")
                await asyncio.sleep(0.1)

    async def request(self, app: Celery, request: RenderTask[ResultT], *, timeout: float,
                      worker_return: float = 0.0) -> ResultT | RenderFailure:
        """Send ``request`` (``inference.protocol.render``) to its task and queue and await the worker's typed
        answer: its result or a ``RenderFailure``. Waits and raises as ``call``."""
        reply = await self.call(app, request.task, request.to_wire(), queue=request.queue, timeout=timeout,
                                worker_return=worker_return)
        return request.parse_reply(reply)

    async def call(self, app: Celery, task_name: str, payload: dict[str, Any], *, queue: str, timeout: float,
                   worker_return: float = 0.0) -> Any:
        """Send ``task_name(payload)`` to ``queue`` and await the value the worker publishes back.

        ``timeout``: seconds to wait while a render worker is alive; ``worker_return``: seconds to wait, from the
        send, for one to come back while none is (its beats, ``inference.api.render_liveness``; 0: a fixed
        ``timeout``). The beats are read only once ``timeout`` has passed, and again at each later deadline of
        ``render_liveness.remaining_wait``. The message expires (Celery ``expires``) once nobody waits for it, so a
        redelivered copy is never rendered for a request already refused. The first answer wins; a second one (a
        redelivered task run twice) finds no waiter and is dropped.

        Raises ``RenderUnavailableError`` when no reply arrived in that time (workers down, overloaded, or a task
        killed by its hard time limit).
        """
        await self._ensure_listening()
        loop = asyncio.get_running_loop()
        reply_id = uuid.uuid4().hex
        fut = loop.create_future()
        self._futures[reply_id] = fut
        body = {**payload, "reply_to": self.channel, "reply_id": reply_id}
        longest = timeout + max(0.0, worker_return)
        # argsrepr/kwargsrepr given: Celery would otherwise build a saferepr of the whole payload for the message
        # headers on every call (~0.4 ms of CPU per publish on the api process)
        argsrepr = f"[<{task_name} payload, reply {reply_id}>]"
        publisher = self._publisher(app)

        async def publish(resent: bool = False) -> None:
            # a copy sent again is marked: the worker counts it with the copies the broker handed back
            # (inference.workers.render_limits.redelivery_refusal), so a render that kills its worker runs at most twice
            args = [{**body, "resent": True} if resent else body]
            if publisher is not None:
                await publisher.send(task_name, args, queue=queue, expires=expires_at(longest), argsrepr=argsrepr)
                return

            def send() -> None:
                app.send_task(task_name, args=args, queue=queue, ignore_result=True, expires=expires_at(longest),
                              argsrepr=argsrepr, kwargsrepr="{}")

            await loop.run_in_executor(self._pool(), send)

        try:
            await publish()
            deadline = _Deadline(self, fut, loop.time(), timeout, worker_return, publish, queue)
            try:
                return await fut
            finally:
                deadline.cancel()
        finally:
            self._futures.pop(reply_id, None)

    async def _workers_state(self) -> RenderWorkersState:
        """The render workers' beats now; when Redis cannot say, as if none had ever beaten (the request then
        waits for ``worker_return`` at most)."""
        try:
            return await workers_state(self._redis, self.prefix)
        except RedisError:
            log.warning("render worker liveness unreadable", exc_info=True)
            return NO_WORKER_SEEN


class _Deadline:
    """The timer of one render wait: when it fires, the workers' beats decide (``remaining_wait``) whether the reply
    future gets ``RenderUnavailableError`` or the timer is set again. One ``call_later`` per request on the happy
    path: ~8 µs of CPU less than ``asyncio.wait_for`` (what the wait used before) and ~15 µs less than
    ``asyncio.wait``, measured on the 2-core box."""

    def __init__(self, waiter: RenderReplyWaiter, fut: asyncio.Future[Any], sent: float, timeout: float,
                 worker_return: float, publish: Callable[[bool], Awaitable[None]], queue: str = RENDER_QUEUE):
        self._waiter, self._fut, self._sent, self._publish, self._queue = waiter, fut, sent, publish, queue
        self._republished = False
        self._timeout, self._worker_return = timeout, worker_return
        self._loop = fut.get_loop()
        self._check: asyncio.Task[None] | None = None
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(timeout, self._fire)

    def cancel(self) -> None:
        """Stop the timer (and a check under way)."""
        if self._handle is not None:
            self._handle.cancel()
        if self._check is not None:
            self._check.cancel()

    def _fire(self) -> None:
        self._handle = None
        if not self._fut.done():
            self._check = self._loop.create_task(self._decide())

    async def _decide(self) -> None:
        waited = self._loop.time() - self._sent
        try:
            state = await self._waiter._workers_state() if self._worker_return > 0 else NO_WORKER_SEEN
        except Exception:  # never leave the request waiting with no timer: decide as if no worker had ever beaten
            log.exception("render worker liveness check failed")
            state = NO_WORKER_SEEN
        if self._fut.done():
            return
        wait = remaining_wait(waited, state, self._timeout, self._worker_return)
        if wait <= 0 and state.alive and self._worker_return > 0 and not self._republished:
            # a worker is alive and has not answered: the task may have been lost in the one gap the broker's
            # redelivery does not cover (a worker killed between popping the message and indexing it as
            # unacknowledged); render it again, once (idempotent, same reply id: the first answer wins), and wait
            # half the timeout more (D-194)
            self._republished = True
            try:
                await self._publish(True)
                wait = min(self._timeout / 2, self._timeout + self._worker_return - waited)
            except Exception:
                log.exception("render task could not be sent again")
            if self._fut.done():
                return
        if wait <= 0:
            what = "render" if self._queue == RENDER_QUEUE else self._queue
            self._fut.set_exception(RenderUnavailableError(f"No {what} worker answered within {waited:.0f} s",
                                                           self._queue))
        else:
            self._handle = self._loop.call_later(wait, self._fire)
