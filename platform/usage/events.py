"""Usage events: the hot path's only usage write is one XADD to a Redis stream (docs/ARCHITECTURE.md §7).

Stream ``{LINK_PREFIX}:usage:events`` (approximate MAXLEN ``USAGE_STREAM_MAXLEN``); one entry per
finished request, field ``e`` = msgpack of the event dict below. ``usage.services.usage_events_flush``
(Celery task ``usage.flush_usage_events``) turns entries into ``UsageRecord`` rows in batches.

Event dict (keys other than ``request_id`` are optional; defaults in brackets):

===================  ==========================================================================
``request_id``       str, unique per request (use the internal id, e.g. ``chatcmpl-<ext>-<hex8>``)
``tenant_id``        int | None [None]          ``api_key_id``    int | None [None]
``served_model_name`` str [""]                  ``endpoint``      str [""] e.g. ``chat.completions``
``prompt_tokens``    int [0]   ``completion_tokens`` int [0]   ``cached_tokens`` int [0] (all n choices)
``status_code``      int [200]                  ``finish_reason`` str | None [""] (first choice's)
``ttft_ms``          float | None [None]        ``e2e_latency_ms`` float [0.0]
``n``                int [1]
``created_at``       request arrival: unix seconds (float) or aware ``datetime`` [finished_at]
``finished_at``      unix seconds (float) or aware ``datetime`` [time of emit]
===================  ==========================================================================
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import msgpack
from django.conf import settings

USAGE_STREAM_MAXLEN = 1_000_000
USAGE_GROUP = "usage-writers"
EVENT_FIELD = "e"


def usage_stream_key() -> str:
    """Redis key of the usage event stream: ``{settings.LINK_PREFIX}:usage:events``."""
    return f"{settings.LINK_PREFIX}:usage:events"


def _ts(value: Any) -> Any:
    return value.timestamp() if isinstance(value, datetime) else value


def usage_event_encode(event: dict[str, Any]) -> bytes:
    """msgpack bytes of ``event`` (datetimes become unix seconds; ``finished_at`` defaults to now).

    Raises ``ValueError`` when ``request_id`` is missing or not a non-empty string, ``TypeError`` when a
    value cannot be packed.
    """
    request_id = event.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise ValueError("usage event needs a non-empty str request_id")
    payload = {key: _ts(value) for key, value in event.items()}
    payload.setdefault("finished_at", time.time())
    return msgpack.packb(payload, use_bin_type=True)


async def usage_event_emit(redis_client_async, event: dict[str, Any]) -> bytes:
    """Append one usage event to the stream with one XADD (``redis.asyncio`` client); returns the entry id.

    Call exactly once per request, whatever its outcome. Raises like ``usage_event_encode`` and
    ``redis.exceptions.RedisError`` when Redis is unreachable.
    """
    return await redis_client_async.xadd(
        usage_stream_key(),
        {EVENT_FIELD: usage_event_encode(event)},
        maxlen=USAGE_STREAM_MAXLEN,
        approximate=True,
    )


def usage_event_emit_sync(redis_client, event: dict[str, Any]) -> bytes:
    """Synchronous ``usage_event_emit`` for sync code (Celery tasks, management commands)."""
    return redis_client.xadd(
        usage_stream_key(),
        {EVENT_FIELD: usage_event_encode(event)},
        maxlen=USAGE_STREAM_MAXLEN,
        approximate=True,
    )
