"""Whether the client of the request being handled has gone away, for waits that must not outlive it.

``GatewayConsumer`` cancels its handler task when the client disconnects (``gateway.http``). On Python 3.11 a
cancellation can be lost: ``asyncio.wait_for`` returns its inner result when that finished in the same loop
iteration as the cancellation (fixed in 3.12, CPython gh-86296), and redis-py sends every command through
``wait_for`` when it has a socket timeout; asgiref's ``sync_to_async`` likewise waits for a running function and
returns its result. A handler whose cancellation was lost in one of them went on to wait for engine output that,
with the client gone, nobody reads, holding its admission reservation until the engine answered (measured: 6 of 40
disconnects right after admission, with the engine paused, every one inside redis-py's ``wait_for`` of a send).

So the consumer also raises this flag, and the waits that can last (engine output: ``GenerationRun.deltas``,
``run_pooling``) check it before each wait: a handler that missed its cancellation raises ``CancelledError`` there
and releases what it holds through its ``finally`` blocks as if the cancellation had arrived.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar


class ClientGone:
    """Set once by the consumer when the client disconnected before the response was complete."""

    __slots__ = ("gone",)

    def __init__(self) -> None:
        self.gone = False


_CURRENT: ContextVar[ClientGone | None] = ContextVar("gateway_client_gone", default=None)


def bind(flag: ClientGone) -> None:
    """Make ``flag`` the current task's (call at the start of the handler task: a task's context is its own)."""
    _CURRENT.set(flag)


def raise_if_client_gone() -> None:
    """Raise ``asyncio.CancelledError`` when the current request's client has gone away (no-op outside a gateway
    request)."""
    flag = _CURRENT.get()
    if flag is not None and flag.gone:
        raise asyncio.CancelledError("the client disconnected")
