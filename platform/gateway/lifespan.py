"""ASGI lifespan of an api process: its admission lease and reaper run from start-up, not from its first request.

The admission client (``inference/api/admission.py``) refreshes this process's lease and reaps the reservations of dead
holders every ``LEASE_REFRESH_S``. Started lazily on the first request, a freshly restarted api that nobody called
yet reaped nothing, so a killed api's reservations stayed counted until traffic came (DECISIONS D-162, D-180).
uvicorn (``--lifespan auto``, its default) sends ``lifespan.startup`` on the loop it serves requests on; the client
is created there (``gateway.clients.admission``, one per process and loop), so requests share it. At
``lifespan.shutdown`` its lease is given up, so whatever it still holds is reaped at once by any live process.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from gateway.clients import admission

log = logging.getLogger(__name__)

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def lifespan(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """The ASGI ``lifespan`` application (ASGI spec, lifespan protocol 2.0): at ``lifespan.startup`` start this
    process's admission client (lease refresh + reaper, ``Admission.start``); at ``lifespan.shutdown`` close it
    (its lease dropped, its reservations reaped). A failure at start-up is logged and start-up still completes:
    the client is then created by the first request, as before, and the api serves."""
    started = False
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                admission()
                started = True
            except Exception:  # the api must start even when Redis is not up yet; requests retry
                log.exception("admission client not started at start-up; the first request starts it")
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if started:
                try:
                    await admission().close()
                except Exception:  # shutting down: the lease lapses by itself (LEASE_TTL_S)
                    log.exception("admission client close failed at shutdown")
            await send({"type": "lifespan.shutdown.complete"})
            return
