"""The api process's shared clients, one per process and event loop: its Redis pool, its engine link and its
admission client. Every gateway module gets them here (nothing else builds a Redis client)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Coroutine

import redis.asyncio as aioredis
from django.conf import settings
from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError

from inference.api.admission import Admission
from inference.api.engine_client import EngineLink

log = logging.getLogger(__name__)

_pools: dict[int, tuple[asyncio.AbstractEventLoop, aioredis.Redis]] = {}
_tasks: set[asyncio.Task[None]] = set()
RETRY_WITHIN_S = 60.0  # how long a write that Redis refused is retried (a Redis restart takes seconds)


def redis() -> aioredis.Redis:
    """This process's Redis pool for the running event loop (``settings.REDIS_URL``; created on first use): key
    limits, usage events, image slots, the feature cache, the generate abort map."""
    loop = asyncio.get_running_loop()
    entry = _pools.get(id(loop))
    if entry is None or entry[0] is not loop:
        entry = (loop, aioredis.Redis.from_url(settings.REDIS_URL, max_connections=256))
        _pools[id(loop)] = entry
    return entry[1]


def link() -> EngineLink:
    """This process's engine link (docs/ARCHITECTURE.md §2 steps 9-10, §6)."""
    return EngineLink.for_current_process(settings.REDIS_URL, settings.LINK_PREFIX)


def admission() -> Admission:
    """This process's shared-admission client (docs/ARCHITECTURE.md §3)."""
    return Admission.for_current_process(settings.REDIS_URL, settings.LINK_PREFIX)


def background(coro: Coroutine[object, object, None], name: str | None = None) -> asyncio.Task[None]:
    """Run ``coro`` on the running loop on a task of its own, referenced here until it ends (the loop keeps only a
    weak reference to a task: one nobody holds may be collected before it ran); returns the task. For the request
    path's work that outlives a step or its request: retries, a usage event, a release, a count, an abort."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    return task


def retry_later(call: Callable[[], Awaitable[object]], what: str, within_s: float = RETRY_WITHIN_S) -> None:
    """Retry an idempotent Redis write that failed because Redis was unreachable (a restart), in the background:
    ``call()`` again after 0.25 s, doubling to 2 s, until it succeeds or ``within_s`` seconds have passed (then
    logged). For what must not be lost while this process lives: a request's admission release (its holder's lease
    stays alive, so the reaper would never free it), its key-limit settle, its usage event. Never raises; the task
    is kept referenced until it ends. DECISIONS D-183."""
    async def run() -> None:
        deadline = time.monotonic() + within_s
        delay = 0.25
        while True:
            await asyncio.sleep(delay)
            try:
                await call()
                return
            except (RedisConnectionError, RedisTimeoutError, OSError):
                if time.monotonic() + delay > deadline:
                    log.exception("%s: Redis still unreachable after %.0f s; given up", what, within_s)
                    return
                delay = min(2.0, delay * 2)
            except Exception:
                log.exception("%s failed", what)
                return
    background(run(), f"retry {what}")
