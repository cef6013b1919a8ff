"""Await Celery render/tokenize tasks from an asyncio loop without holding a thread per waiting request.

Celery's own ``AsyncResult.get`` blocks a thread while it waits. Its Redis result backend, though, publishes
every stored result on the Pub/Sub channel named like the result key (``celery-task-meta-<task id>``), so
one ``redis.asyncio`` Pub/Sub connection per process can wait for any number of results: subscribe to the
task's channel first, then publish the task, then await the message (DESIGN.md §2: "awaiting a Celery result
must not hold a thread per waiting request"). Publishing itself runs on a small thread pool because kombu's
producer is synchronous.

This is the one piece here that a library should have provided; Celery has no asyncio result API.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import redis.asyncio as aioredis

log = logging.getLogger(__name__)

RESULT_KEY_PREFIX = "celery-task-meta-"


class RenderUnavailableError(RuntimeError):
    """No render worker answered in time (maps to HTTP 503)."""


class CeleryResultWaiter:
    """One Pub/Sub connection per event loop that resolves futures keyed by Celery task id."""

    _instances: ClassVar[dict[int, "CeleryResultWaiter"]] = {}
    _publish_pool: ClassVar[ThreadPoolExecutor | None] = None

    def __init__(self, redis_url: str):
        self._redis = aioredis.Redis.from_url(redis_url)
        self._pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        self._futures: dict[str, asyncio.Future] = {}
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    @classmethod
    def for_current_loop(cls, redis_url: str) -> "CeleryResultWaiter":
        """The waiter bound to the running loop (created on first use)."""
        loop = asyncio.get_running_loop()
        waiter = cls._instances.get(id(loop))
        if waiter is None:
            waiter = cls(redis_url)
            cls._instances[id(loop)] = waiter
        return waiter

    @classmethod
    def _pool(cls) -> ThreadPoolExecutor:
        if cls._publish_pool is None:
            cls._publish_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="celery-publish")
        return cls._publish_pool

    async def _listen(self) -> None:
        while True:
            try:
                if not self._pubsub.subscribed:
                    await asyncio.sleep(0.01)
                    continue
                msg = await self._pubsub.get_message(timeout=1.0)
                if msg is None or msg.get("type") != "message":
                    continue
                channel = msg["channel"].decode()
                task_id = channel[len(RESULT_KEY_PREFIX):]
                fut = self._futures.get(task_id)
                if fut is not None and not fut.done():
                    fut.set_result(json.loads(msg["data"]))
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep listening after a hiccup
                log.exception("celery result listener error")
                await asyncio.sleep(0.1)

    async def call(self, app, task_name: str, args: list[Any], *, queue: str, timeout: float) -> Any:
        """Publish ``task_name(*args)`` to ``queue`` and await its return value.

        Raises ``RenderUnavailableError`` when no result arrives within ``timeout`` seconds and
        ``RuntimeError`` when the task itself raised (tasks here return structured errors instead).
        """
        task_id = uuid.uuid4().hex
        channel = RESULT_KEY_PREFIX + task_id
        fut = asyncio.get_running_loop().create_future()
        self._futures[task_id] = fut
        try:
            async with self._lock:
                await self._pubsub.subscribe(channel)
            if self._task is None or self._task.done():
                self._task = asyncio.get_running_loop().create_task(self._listen())
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._pool(), lambda: app.send_task(
                task_name, args=args, queue=queue, task_id=task_id))
            try:
                meta = await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                raw = await self._redis.get(channel)  # a result stored while we were subscribing
                if raw is None:
                    raise RenderUnavailableError(
                        f"No render worker answered within {timeout:.0f} s") from None
                meta = json.loads(raw)
        finally:
            self._futures.pop(task_id, None)
            try:
                async with self._lock:
                    await self._pubsub.unsubscribe(channel)
            except Exception:  # noqa: BLE001
                pass
        if meta.get("status") != "SUCCESS":
            raise RuntimeError(f"render task failed: {meta.get('result')}")
        return meta.get("result")
