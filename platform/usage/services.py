"""Usage writes: move events from the Redis stream into ``UsageRecord`` rows, in batches, exactly once.

Delivery is at-least-once (consumer group ``usage-writers``; entries are acknowledged only after the
rows are committed; entries left pending by a dead consumer are claimed after ``claim_idle_ms``);
``UsageRecord.request_id`` is unique and rows are inserted with ``ON CONFLICT DO NOTHING``, so a re-delivered
event never makes a second row: together, exactly one row per request. The rows a batch really inserted
are added to the minute/hour/day rollups in the same transaction, so each record is rolled up once.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import socket
from datetime import datetime, timezone as dt_timezone
from typing import Any

import msgpack
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from redis.exceptions import ResponseError

from tenancy.models import ApiKey, Tenant

from .events import EVENT_FIELD, USAGE_GROUP, usage_stream_key
from .models import UsageRecord
from .record_insert import UsageRow, usage_rows_insert
from .rollups import usage_rollup_rows

logger = logging.getLogger(__name__)

DEAD_LETTER_MAXLEN = 10_000
CLAIM_IDLE_MS = 30_000
_REQUEST_ID_MAX = 255
_INT_MAX = 2_147_483_647
_SMALLINT_MAX = 32_767


def usage_consumer_name() -> str:
    """This process's consumer name in the ``usage-writers`` group: ``<hostname>-<pid>``."""
    return f"{socket.gethostname()}-{os.getpid()}"


def usage_dead_letter_key() -> str:
    """Redis stream where undecodable or invalid usage events are kept for inspection."""
    return f"{settings.LINK_PREFIX}:usage:dead"


def _group_ensure(redis_client, key: str) -> None:
    try:
        redis_client.xgroup_create(key, USAGE_GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _with_group(redis_client, key: str, call):
    """Run ``call()``; if the group (or stream) does not exist yet, create it and run it once more."""
    try:
        return call()
    except ResponseError as exc:
        if "NOGROUP" not in str(exc):
            raise
    _group_ensure(redis_client, key)
    return call()


def _dt(value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and math.isfinite(value):
        return datetime.fromtimestamp(float(value), tz=dt_timezone.utc)
    if isinstance(value, str):
        parsed = datetime.fromisoformat(value)
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt_timezone.utc)
    raise TypeError(f"not a timestamp: {value!r}")


def _count(value: Any, upper: int = _INT_MAX) -> int:
    return max(0, min(int(value or 0), upper))


def _text(value: Any, max_len: int) -> str:
    """``value`` as column text: at most ``max_len`` characters, each U+0000 replaced by U+FFFD (PostgreSQL's
    ``text``/``varchar`` cannot hold NUL: one such value would fail its whole batch's INSERT, every time the
    batch is claimed again; D-175). Applied on every backend, so SQLite and PostgreSQL store the same text."""
    return str(value or "").replace("\x00", "\ufffd")[:max_len]


def _ms(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def usage_row_from_event(event: dict[str, Any]) -> UsageRow:
    """``UsageRow`` from one decoded event (schema in ``usage.events``); counts clamped to their columns.

    A ``request_id`` longer than 255 characters is stored as ``sha256:<hex>`` (deterministic, so
    idempotency holds); U+0000 in any text column is stored as U+FFFD (``_text``). Raises ``ValueError``/``TypeError`` for an event that cannot be a record.
    """
    request_id = event.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise ValueError("missing request_id")
    if len(request_id) > _REQUEST_ID_MAX:
        request_id = "sha256:" + hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()
    request_id = _text(request_id, _REQUEST_ID_MAX)
    finished_at = _dt(event.get("finished_at")) or datetime.now(tz=dt_timezone.utc)
    created_at = _dt(event.get("created_at")) or finished_at
    tenant_id = event.get("tenant_id")
    api_key_id = event.get("api_key_id")
    return UsageRow(
        request_id=request_id,
        tenant_id=int(tenant_id) if tenant_id is not None else None,
        api_key_id=int(api_key_id) if api_key_id is not None else None,
        served_model_name=_text(event.get("served_model_name"), 128),
        endpoint=_text(event.get("endpoint"), 64),
        prompt_tokens=_count(event.get("prompt_tokens")),
        completion_tokens=_count(event.get("completion_tokens")),
        cached_tokens=_count(event.get("cached_tokens")),
        status_code=_count(event.get("status_code", 200), _SMALLINT_MAX),
        finish_reason=_text(event.get("finish_reason"), 16),
        ttft_ms=_ms(event.get("ttft_ms")),
        e2e_latency_ms=_ms(event.get("e2e_latency_ms")) or 0.0,
        n=_count(event.get("n", 1), _SMALLINT_MAX),
        created_at=created_at,
        finished_at=finished_at,
    )


def usage_record_from_event(event: dict[str, Any]) -> UsageRecord:
    """Unsaved ``UsageRecord`` from one decoded event (``usage_row_from_event``'s rules and errors)."""
    return UsageRecord(**usage_row_from_event(event)._asdict())


def _rows_save(rows: list[UsageRow], *, attempts: int = 3) -> int:
    """Insert ``rows``, roll up the new ones and advance ``ApiKey.last_used_at``, in ONE transaction.

    Existing request_ids are skipped and not rolled up again (exactly-once rollups without a second pass
    over the records: new rows are written with ``rolled_up = True``). A key or tenant deleted since the
    request keeps the record with the reference dropped. A unique-constraint race on a new rollup row
    with a concurrent writer rolls back and retries up to ``attempts`` times. Returns rows inserted.
    """
    tenant_ids = {r.tenant_id for r in rows if r.tenant_id is not None}
    key_ids = {r.api_key_id for r in rows if r.api_key_id is not None}
    known_tenants = set(Tenant.objects.filter(pk__in=tenant_ids).values_list("pk", flat=True)) if tenant_ids else set()
    known_keys = set(ApiKey.objects.filter(pk__in=key_ids).values_list("pk", flat=True)) if key_ids else set()
    if tenant_ids - known_tenants or key_ids - known_keys:
        rows = [r._replace(tenant_id=r.tenant_id if r.tenant_id in known_tenants else None,
                           api_key_id=r.api_key_id if r.api_key_id in known_keys else None) for r in rows]
    for attempt in range(attempts):
        try:
            with transaction.atomic():
                inserted = usage_rows_insert(rows, rolled_up=True)
                new_rows = [r for r in rows if r.request_id in inserted]
                usage_rollup_rows(new_rows)
                _last_used_advance(new_rows)
                return len(new_rows)
        except IntegrityError:
            if attempt == attempts - 1:
                raise
    return 0


def _last_used_advance(rows: list[UsageRow]) -> None:
    last_used: dict[int, datetime] = {}
    for row in rows:
        if row.api_key_id is not None:
            previous = last_used.get(row.api_key_id)
            if previous is None or row.finished_at > previous:
                last_used[row.api_key_id] = row.finished_at
    for key_id, used_at in sorted(last_used.items()):
        ApiKey.objects.filter(pk=key_id).filter(
            Q(last_used_at__isnull=True) | Q(last_used_at__lt=used_at)
        ).update(last_used_at=used_at)


def usage_events_flush(
    *,
    redis_client,
    max_batch: int = 1000,
    consumer: str | None = None,
    claim_idle_ms: int = CLAIM_IDLE_MS,
) -> int:
    """Move up to ``max_batch`` usage events from the stream into the database; returns entries handled.

    ``redis_client`` is a sync ``redis.Redis`` with ``decode_responses=False``. Order: claim entries
    pending longer than ``claim_idle_ms`` (a killed consumer's) with XAUTOCLAIM, read new ones with
    XREADGROUP (group ``usage-writers``, consumer ``consumer`` or ``<hostname>-<pid>``), insert the rows,
    roll up the new ones and advance ``last_used_at`` in one transaction (``usage.record_insert``:
    ``INSERT ... ON CONFLICT DO NOTHING RETURNING``), then XACK and XDEL them. Invalid entries go to the
    dead-letter stream ``{LINK_PREFIX}:usage:dead`` and are acknowledged. If the database write fails
    the exception propagates and the entries stay pending, to be claimed again later.
    """
    if max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    key = usage_stream_key()
    consumer = consumer or usage_consumer_name()

    claimed = _with_group(
        redis_client, key,
        lambda: redis_client.xautoclaim(key, USAGE_GROUP, consumer, claim_idle_ms, start_id="0-0", count=max_batch),
    )
    entries: list[tuple[bytes, dict | None]] = list(claimed[1]) if claimed else []
    if len(entries) < max_batch:
        fresh = _with_group(
            redis_client, key,
            lambda: redis_client.xreadgroup(USAGE_GROUP, consumer, {key: ">"}, count=max_batch - len(entries)),
        )
        for _stream, stream_entries in fresh or []:
            entries.extend(stream_entries)
    if not entries:
        return 0

    rows: dict[str, UsageRow] = {}
    dead: list[tuple[bytes, bytes]] = []
    for entry_id, fields in entries:
        if not fields:  # deleted while pending (Redis 6.2 reports it as nil): nothing to write
            continue
        raw = fields.get(EVENT_FIELD.encode(), fields.get(EVENT_FIELD))
        try:
            event = msgpack.unpackb(raw, raw=False)
            if not isinstance(event, dict):
                raise TypeError("event is not a map")
            row = usage_row_from_event(event)
        except Exception as exc:  # noqa: BLE001 - any bad entry goes to the dead-letter stream
            logger.warning("usage event %r is invalid (%s); moved to %s", entry_id, exc, usage_dead_letter_key())
            dead.append((entry_id, raw if isinstance(raw, bytes) else repr(fields).encode()))
            continue
        rows.setdefault(row.request_id, row)

    if rows:
        _rows_save(list(rows.values()))

    ids = [entry_id for entry_id, _fields in entries]
    pipe = redis_client.pipeline(transaction=False)
    for entry_id, raw in dead:
        pipe.xadd(usage_dead_letter_key(), {"id": entry_id, EVENT_FIELD: raw},
                  maxlen=DEAD_LETTER_MAXLEN, approximate=True)
    pipe.xack(key, USAGE_GROUP, *ids)
    pipe.xdel(key, *ids)
    pipe.execute()
    return len(ids)
