"""Usage rollups: ``UsageRecord`` rows → ``UsageRollup`` rows per key, model and minute/hour/day, and
``UsageTotal`` rows (every key together) per model and minute/hour/day, in the same transaction.

The flush (``usage.services``) rolls up the rows it inserts in the same transaction
(``usage_rollup_rows``). Rows written any other way (``rolled_up = False``) are caught up here.
Incremental and exactly-once: each run takes up to ``max_records`` records with ``rolled_up = False``
(PostgreSQL: ``FOR UPDATE SKIP LOCKED``, so concurrent runs take disjoint records; SQLite: the
``BEGIN IMMEDIATE`` transaction serializes runs), adds them to the minute, hour and day rows (rows
locked ``FOR UPDATE`` before they are read), and flips their ``rolled_up`` flag — all in ONE
transaction. A run that dies leaves nothing half-done; a record is added to its rollups exactly once,
however late it arrives (a record flushed late lands in its own, older bucket).
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

from django.db import IntegrityError, connection, transaction

from .buckets import bucket_floor
from .histogram import bucket_of, hist_add, hist_new
from .key_ranges import key_ranges_add
from .models import GRANULARITIES, UsageRecord, UsageRollup, UsageTotal

_SUM_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "status_429", "status_503",
               "errors", "aborted", "ttft_count", "ttft_sum_ms", "e2e_sum_ms")


def _new_delta() -> dict[str, Any]:
    d: dict[str, Any] = {f: 0 for f in _SUM_FIELDS}
    d["ttft_sum_ms"] = d["e2e_sum_ms"] = 0.0
    d["ttft_hist"] = hist_new()
    d["e2e_hist"] = hist_new()
    return d


def record_classify(status_code: int, finish_reason: str) -> dict[str, int]:
    """The status counters one record adds: ``status_429``, ``status_503``, ``errors`` (other statuses >= 400
    except 499 = client gone, or ``finish_reason == "error"``), ``aborted`` (``finish_reason == "abort"``)."""
    return {
        "status_429": int(status_code == 429),
        "status_503": int(status_code == 503),
        "errors": int((status_code >= 400 and status_code not in (429, 499, 503)) or finish_reason == "error"),
        "aborted": int(finish_reason == "abort"),
    }


def _deltas(records) -> dict[tuple, dict[str, Any]]:
    """Sum ``records`` (tuples, see ``usage_rollup_run``'s fields) per (granularity, bucket, key, tenant, model).

    Per record the bucket starts, status classes and histogram buckets are computed once, not per
    granularity (this runs on the ingestion path for every record).
    """
    out: dict[tuple, dict[str, Any]] = defaultdict(_new_delta)
    starts_of_minute: dict[datetime, tuple[datetime, datetime, datetime]] = {}
    for r in records:
        (_rid, tenant_id, key_id, model, created_at, prompt, completion, cached, status, finish, ttft, e2e) = r
        minute = bucket_floor(created_at, "minute")
        starts = starts_of_minute.get(minute)
        if starts is None:  # once per distinct minute, not per record
            starts = starts_of_minute[minute] = tuple(bucket_floor(minute, g) for g in GRANULARITIES)
        cls = record_classify(status, finish or "")
        ttft_bucket = bucket_of(ttft) if ttft is not None else None
        e2e = e2e or 0.0
        e2e_bucket = bucket_of(e2e)
        tail = (key_id or 0, tenant_id or 0, model or "")
        for gran, start in zip(GRANULARITIES, starts):
            d = out[(gran, start, *tail)]
            d["requests"] += 1
            d["prompt_tokens"] += prompt
            d["completion_tokens"] += completion
            d["cached_tokens"] += cached
            for k, v in cls.items():
                d[k] += v
            if ttft_bucket is not None:
                d["ttft_count"] += 1
                d["ttft_sum_ms"] += ttft
                d["ttft_hist"][ttft_bucket] += 1
            d["e2e_sum_ms"] += e2e
            d["e2e_hist"][e2e_bucket] += 1
    return out


def _totals(deltas: dict[tuple, dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """``deltas`` (keyed ``(granularity, bucket_start, key, tenant, model)``) summed over keys and tenants:
    keyed ``(granularity, bucket_start, model)``."""
    out: dict[tuple, dict[str, Any]] = defaultdict(_new_delta)
    for (gran, start, _key, _tenant, model), d in deltas.items():
        t = out[(gran, start, model)]
        for f in _SUM_FIELDS:
            t[f] += d[f]
        hist_add(t["ttft_hist"], d["ttft_hist"])
        hist_add(t["e2e_hist"], d["e2e_hist"])
    return out


def _apply_rows(model, key_fields: tuple[str, ...], deltas: dict[tuple, dict[str, Any]]) -> None:
    """Add ``deltas`` (keyed by the values of ``key_fields``, ``granularity`` and ``bucket_start`` first) to
    their ``model`` rows (caller holds a transaction). Rows are locked ``FOR UPDATE`` in one order (by id)
    before they are read, so two writers never wait on each other's locks in opposite orders."""
    by_gran: dict[str, list[tuple]] = defaultdict(list)
    for key in deltas:
        by_gran[key[0]].append(key)
    for gran, keys in by_gran.items():
        qs = model.objects.filter(granularity=gran, bucket_start__in={k[1] for k in keys})
        if "api_key_id" in key_fields:
            qs = qs.filter(api_key_id__in={k[key_fields.index("api_key_id")] for k in keys})
        if connection.features.has_select_for_update:
            qs = qs.select_for_update().order_by("id")
        existing = {tuple(getattr(r, f) for f in key_fields): r for r in qs}
        to_update, to_create = [], []
        for key in keys:
            d = deltas[key]
            row = existing.get(key)
            if row is None:
                row = model(**dict(zip(key_fields, key)), ttft_hist=[], e2e_hist=[])
                to_create.append(row)
            else:
                to_update.append(row)
            for f in _SUM_FIELDS:
                setattr(row, f, getattr(row, f) + d[f])
            row.ttft_hist = hist_add(list(row.ttft_hist or []), d["ttft_hist"])
            row.e2e_hist = hist_add(list(row.e2e_hist or []), d["e2e_hist"])
        if to_update:
            model.objects.bulk_update(to_update, [*_SUM_FIELDS, "ttft_hist", "e2e_hist"], batch_size=500)
        if to_create:
            model.objects.bulk_create(to_create, batch_size=500)


_ROLLUP_KEY = ("granularity", "bucket_start", "api_key_id", "tenant_id", "served_model_name")
_TOTAL_KEY = ("granularity", "bucket_start", "served_model_name")


def _apply(deltas: dict[tuple, dict[str, Any]]) -> None:
    """Add ``deltas`` to their ``UsageRollup`` rows, their sums to the ``UsageTotal`` rows and to the per-key range
    totals (``usage.key_ranges``); caller holds a transaction."""
    _apply_rows(UsageRollup, _ROLLUP_KEY, deltas)
    _apply_rows(UsageTotal, _TOTAL_KEY, _totals(deltas))
    key_ranges_add(deltas)


def usage_rollup_rows(rows) -> None:
    """Add ``rows`` (``usage.record_insert.UsageRow``, just inserted with ``rolled_up = True``) to the rollups.

    Call inside the transaction that inserted them, so the records and their rollups commit together.
    Raises ``IntegrityError`` when a concurrent writer created the same new rollup row first (the caller
    retries the transaction).
    """
    if rows:
        _apply(_deltas((None, r.tenant_id, r.api_key_id, r.served_model_name, r.created_at, r.prompt_tokens,
                        r.completion_tokens, r.cached_tokens, r.status_code, r.finish_reason, r.ttft_ms,
                        r.e2e_latency_ms) for r in rows))


def usage_rollup_run(*, max_records: int = 5000, attempts: int = 3) -> int:
    """Add up to ``max_records`` not-yet-rolled-up records to the rollups; returns how many were added.

    One transaction per call (see the module docstring). A unique-constraint race with a concurrent run
    (both creating the same new row) rolls back and is retried up to ``attempts`` times.
    """
    fields = ("id", "tenant_id", "api_key_id", "served_model_name", "created_at", "prompt_tokens",
              "completion_tokens", "cached_tokens", "status_code", "finish_reason", "ttft_ms", "e2e_latency_ms")
    for attempt in range(attempts):
        try:
            with transaction.atomic():
                qs = UsageRecord.objects.filter(rolled_up=False).order_by("id")
                if connection.features.has_select_for_update_skip_locked:
                    qs = qs.select_for_update(skip_locked=True)
                records = list(qs.values_list(*fields)[:max_records])
                if not records:
                    return 0
                _apply(_deltas(records))
                ids = [r[0] for r in records]
                for i in range(0, len(ids), 900):
                    UsageRecord.objects.filter(id__in=ids[i:i + 900]).update(rolled_up=True)
                return len(records)
        except IntegrityError:
            if attempt == attempts - 1:
                raise
    return 0


def usage_rollup_all(*, max_records: int = 5000, max_rounds: int = 100) -> int:
    """Run ``usage_rollup_run`` until no records are left or ``max_rounds`` ran; returns records added."""
    total = 0
    for _ in range(max_rounds):
        n = usage_rollup_run(max_records=max_records)
        total += n
        if n < max_records:
            break
    return total
