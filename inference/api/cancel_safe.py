"""Taking a shared resource in Redis without leaking it when the caller is cancelled mid-call.

A Lua script that reserves something (an admission reservation, a key's concurrency slot) runs on the Redis
server as soon as its bytes arrive. If the awaiting task is cancelled before the reply is read (a client that
disconnects at that moment), the server holds the reservation but no one holds its handle, so no ``finally``
can give it back; an admission reservation of a live process is never reaped, so the slot is lost for good.
``take_or_undo`` closes that window: the reply is awaited in a task of its own, and a cancelled caller leaves
behind a background task that waits for it and undoes what was taken.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_pending: set[asyncio.Task[None]] = set()  # undo tasks still running (strong references until done)


async def take_or_undo(take: Awaitable[T], undo: Callable[[T], Awaitable[object]]) -> T:
    """Await ``take`` and return its result, shielded from the caller's cancellation.

    When the caller is cancelled first, ``CancelledError`` is raised at once and ``take`` is left to finish in
    the background; if it succeeds, ``undo(result)`` runs then (its errors are logged). If ``take`` raises (a
    refusal, nothing held), nothing is undone. ``take``: a coroutine or future; ``undo``: an async callable.
    """
    task = asyncio.ensure_future(take)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        undoer = asyncio.ensure_future(_undo_when_taken(task, undo))
        _pending.add(undoer)
        undoer.add_done_callback(_pending.discard)
        raise


async def _undo_when_taken(task: asyncio.Future[T], undo: Callable[[T], Awaitable[object]]) -> None:
    try:
        value = await task
    except BaseException:  # noqa: BLE001 - refused, failed or cancelled: nothing was handed out to undo
        return
    try:
        await undo(value)
    except Exception:
        log.exception("undoing a reservation taken by a cancelled caller failed")
