"""One lookup in flight per key: concurrent cache misses on an event loop share one fetch (no stampede).

The per-process caches of the request path (``gateway.auth``'s verified keys, ``gateway.model_cache``'s served-model
snapshots) live for a second. When a burst of requests with one key and one model arrives after an idle second,
every request missed at once and ran its own ORM lookup in the thread pool: 16 streaming chats at once cost 32
lookups, each opening a database connection on SQLite, which was half of the api process's CPU in that burst
(DECISIONS D-302). With ``SingleFlight`` the first miss starts the fetch and the others await the same result.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable, Coroutine, Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class SingleFlight(Generic[V]):
    """``run(key, fetch, tag, max_age_s)``: the result of the fetch already in flight for ``key`` on this event loop
    with the same ``tag`` that started less than ``max_age_s`` seconds ago, else of a new ``fetch()`` started as a
    task.

    - The fetch is shielded: a caller that is cancelled (its client went away) neither cancels it nor the other
      callers' wait; a fetch nobody awaits any more still finishes (and fills its cache). It runs in an empty
      ``contextvars`` context, so no caller's request state (e.g. its client-gone flag) leaks into it.
    - ``tag`` separates fetches that must not be shared: a caller whose tag differs from the in-flight fetch's
      (e.g. a cache generation bumped by an invalidation since that fetch started) starts its own.
    - ``max_age_s`` bounds how old a read a caller may be given: past it (a slow or stuck lookup), a new caller
      starts its own fetch, as a cache entry is not served past its lifetime either.
    - A fetch's exception is raised to every caller that awaits it; it is never cached here (the next miss fetches
      again). At most one entry per key and event loop in flight: bounded by the lookups running, not by traffic.
    """

    def __init__(self) -> None:
        self._in_flight: dict[tuple[asyncio.AbstractEventLoop, Hashable], tuple[asyncio.Task[V], Hashable, float]] = {}

    async def run(self, key: Hashable, fetch: Callable[[], Coroutine[Any, Any, V]], tag: Hashable = None,
                  max_age_s: float = 1.0) -> V:
        """The shared result of ``fetch()`` for ``key`` (see the class); raises what ``fetch`` raises."""
        loop = asyncio.get_running_loop()
        slot = (loop, key)
        entry = self._in_flight.get(slot)
        now = loop.time()
        if entry is not None and entry[1] == tag and now - entry[2] < max_age_s and not entry[0].done():
            task = entry[0]
        else:
            task = loop.create_task(fetch(), context=contextvars.Context())  # fetch() only builds the coroutine
            self._in_flight[slot] = (task, tag, now)
            task.add_done_callback(functools.partial(self._forget, slot))
        return await asyncio.shield(task)

    def in_flight(self) -> int:
        """How many fetches are running (for tests and diagnostics)."""
        return len(self._in_flight)

    def _forget(self, slot: tuple[asyncio.AbstractEventLoop, Hashable], done: asyncio.Task[V]) -> None:
        entry = self._in_flight.get(slot)
        if entry is not None and entry[0] is done:
            del self._in_flight[slot]
        if not done.cancelled():
            done.exception()  # retrieved: a failed fetch whose callers all left is not logged as never retrieved
