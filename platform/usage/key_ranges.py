"""Per-key totals over each dashboard range (``UsageKeyRange``), so the operator's key table ranks 100,000 keys by
reading an index instead of summing every key's rollups per request (issue 17; DECISIONS D-155..D-157).

Invariant, per range ``R`` (granularity ``g``, ``usage.buckets.RANGES``) once its ``UsageKeyRangeWindow`` row has
a ``start``: the ``UsageKeyRange`` row of (``R``, key) holds the sum of that key's committed ``UsageRollup`` rows
of granularity ``g`` with ``bucket_start >= start`` (no row: zero). Three writers keep it:

- ``key_ranges_add`` (inside the rollup writers' transaction, ``usage.rollups._apply``): adds the new records of
  buckets at or after ``start``, read under ``FOR SHARE`` of the window rows (PostgreSQL).
- ``usage_key_ranges_advance`` (every run of the flush task, about once a second): moves ``start`` to the
  current range start and subtracts the rollup buckets that left the window, under ``FOR UPDATE`` of the window
  row, so no rollup transaction is between reading the window and committing. A window that moved by a whole
  span or more (first run, long downtime, clock set back) is rebuilt from the rollups instead.
- ``usage_key_ranges_rebuild``: that rebuild, also used by the scale data builder.

Staleness: between a bucket boundary and the next advance (the flush period, ~1 s) a range also counts its
oldest, just-expired bucket; new traffic is never missing. Readers check ``key_range_window_fresh``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.db.models import Max, Sum
from django.utils import timezone

from .buckets import GRANULARITY_STEP, RANGES, usage_range
from .models import UsageKeyRange, UsageKeyRangeWindow, UsageRollup

KEY_RANGE_SUMS = ("requests", "prompt_tokens", "completion_tokens", "status_429", "status_503", "errors")
# advanced_at is rewritten at most this often while the window has not moved (no write per flush run).
ADVANCED_AT_EVERY = timedelta(seconds=10)
# A window not checked for this long means the advance is not running: readers fall back to the live query.
KEY_RANGES_MAX_AGE = timedelta(seconds=60)
_UPSERT_ROWS = 500  # rows per INSERT at most (9 parameters each), fewer where the backend caps parameters


def _qn(name: str) -> str:
    return connection.ops.quote_name(name)


def _table() -> str:
    return _qn(UsageKeyRange._meta.db_table)


def _upsert_sql(values_sql: str) -> str:
    """``INSERT`` of ``(range_name, api_key_id, tenant_id, *sums)`` rows from ``values_sql`` that adds the sums to
    an existing row of the same (range, key) (PostgreSQL and SQLite >= 3.24 ``ON CONFLICT``)."""
    t = _table()
    cols = ", ".join(_qn(c) for c in ("range_name", "api_key_id", "tenant_id", *KEY_RANGE_SUMS))
    sets = ", ".join(f"{_qn(f)} = {t}.{_qn(f)} + excluded.{_qn(f)}" for f in KEY_RANGE_SUMS)
    return (f"INSERT INTO {t} ({cols}) {values_sql} ON CONFLICT ({_qn('range_name')}, {_qn('api_key_id')}) "
            f"DO UPDATE SET {sets}")


def _windows_for_add() -> dict[str, datetime]:
    """``{range: start}`` of the built windows, share-locked until the caller's transaction ends (PostgreSQL)."""
    w = UsageKeyRangeWindow._meta
    sql = (f"SELECT {_qn('range_name')}, {_qn('start')}, {_qn('advanced_at')} FROM {_qn(w.db_table)} "
           f"ORDER BY {_qn('range_name')}")
    if connection.vendor == "postgresql":
        sql += " FOR SHARE"
    return {row.range_name: row.start for row in UsageKeyRangeWindow.objects.raw(sql) if row.start is not None}


def key_ranges_add(deltas: dict[tuple, dict[str, Any]]) -> None:
    """Add rollup ``deltas`` (``usage.rollups._deltas``: keyed ``(granularity, bucket_start, api_key_id,
    tenant_id, model)``) to the ``UsageKeyRange`` rows of each built range whose window holds the bucket.

    Call inside the transaction that writes the same deltas to ``UsageRollup``. Rows are written in (range, key)
    order, so concurrent writers take row locks in one order. Deltas without a key (id 0) are skipped.
    """
    if not deltas:
        return
    windows = _windows_for_add()
    if not windows:
        return
    by_gran = {gran: (name, windows[name]) for name, (_span, gran) in RANGES.items() if name in windows}
    acc: dict[tuple[str, int], list[int]] = {}
    for (gran, start, key_id, tenant_id, _model), d in deltas.items():
        target = by_gran.get(gran)
        if not key_id or target is None or start < target[1]:
            continue
        row = acc.get((target[0], key_id))
        if row is None:
            row = acc[(target[0], key_id)] = [tenant_id, *(0 for _ in KEY_RANGE_SUMS)]
        for i, f in enumerate(KEY_RANGE_SUMS, 1):
            row[i] += d[f]
    items = sorted(acc.items())
    width = 3 + len(KEY_RANGE_SUMS)
    per = max(1, min(_UPSERT_ROWS, (connection.features.max_query_params or 10**6) // width))
    with connection.cursor() as cur:
        for i in range(0, len(items), per):
            chunk = items[i:i + per]
            values = ", ".join(["(" + ", ".join(["%s"] * width) + ")"] * len(chunk))
            params = [v for (name, key_id), row in chunk for v in (name, key_id, *row)]
            cur.execute(_upsert_sql(f"VALUES {values}"), params)


def _key_sums_sql(gran: str, start: datetime, end: datetime | None, sign: str = "") -> tuple[str, tuple]:
    """``SELECT api_key_id, tenant_id, *sums`` of the rollups of ``gran`` in ``[start, end)`` (``end`` None: no
    end), one row per key with a key, sums negated when ``sign`` is ``"-"``."""
    qs = UsageRollup.objects.filter(granularity=gran, bucket_start__gte=start, api_key_id__gt=0)
    if end is not None:
        qs = qs.filter(bucket_start__lt=end)
    inner, params = (qs.order_by().values("api_key_id")
                     .annotate(t=Max("tenant_id"), **{f"s_{f}": Sum(f) for f in KEY_RANGE_SUMS})
                     .query.sql_with_params())
    sums = ", ".join(f"{sign}sub.{_qn('s_' + f)}" for f in KEY_RANGE_SUMS)
    return f"SELECT sub.{_qn('api_key_id')}, sub.{_qn('t')}, {sums} FROM ({inner}) sub WHERE true", params


def _rebuild(range_name: str, start: datetime) -> None:
    """Replace the range's rows by the sums of its rollups from ``start`` (caller holds the window lock)."""
    gran = RANGES[range_name][1]
    select, params = _key_sums_sql(gran, start, None)
    cols = ", ".join(_qn(c) for c in ("range_name", "api_key_id", "tenant_id", *KEY_RANGE_SUMS))
    with connection.cursor() as cur:
        cur.execute(f"DELETE FROM {_table()} WHERE {_qn('range_name')} = %s", [range_name])
        cur.execute(f"INSERT INTO {_table()} ({cols}) SELECT %s, s.* FROM ({select}) s", [range_name, *params])


def _subtract(range_name: str, old: datetime, new: datetime) -> None:
    """Subtract the range's rollup buckets in ``[old, new)`` and drop rows left with no requests."""
    gran = RANGES[range_name][1]
    select, params = _key_sums_sql(gran, old, new, sign="-")
    with connection.cursor() as cur:
        cur.execute(_upsert_sql(f"SELECT %s, s.* FROM ({select}) s WHERE true"), [range_name, *params])
        cur.execute(f"DELETE FROM {_table()} WHERE {_qn('range_name')} = %s AND {_qn('requests')} <= 0",
                    [range_name])


def _ensure_window_rows() -> None:
    """Create the missing window rows (``start`` None: not built), committed on their own, so that every later
    writer finds a row to lock."""
    missing = set(RANGES) - set(UsageKeyRangeWindow.objects.values_list("range_name", flat=True))
    if missing:
        now = timezone.now()
        UsageKeyRangeWindow.objects.bulk_create(
            [UsageKeyRangeWindow(range_name=n, start=None, advanced_at=now) for n in sorted(missing)],
            ignore_conflicts=True)


def _advance_one(range_name: str, now: datetime, force_rebuild: bool) -> str:
    span, gran = RANGES[range_name]
    new_start = usage_range(range_name, now)[0]
    current = UsageKeyRangeWindow.objects.filter(pk=range_name).values_list("start", "advanced_at").first()
    if (not force_rebuild and current is not None and current[0] == new_start
            and now - current[1] < ADVANCED_AT_EVERY):
        return "unchanged"  # nothing to do: no transaction, no lock
    with transaction.atomic():
        window = UsageKeyRangeWindow.objects.select_for_update().get(pk=range_name)
        old = window.start
        if force_rebuild or old is None or new_start < old or new_start - old >= span:
            _rebuild(range_name, new_start)
            outcome = "rebuilt"
        elif new_start > old:
            _subtract(range_name, old, new_start)
            outcome = "advanced"
        else:
            outcome = "unchanged"
        window.start, window.advanced_at = new_start, now
        window.save(update_fields=["start", "advanced_at"])
    return outcome


def usage_key_ranges_advance(now: datetime | None = None, *, force_rebuild: bool = False) -> dict[str, str]:
    """Bring every range's ``UsageKeyRange`` rows to the range's current window (``usage_range(name, now)``):
    ``{range: "unchanged" | "advanced" | "rebuilt"}``.

    One short transaction per range. Cheap when nothing moved (one read per range); a minute boundary subtracts
    one minute of minute rollups from ``hour``, an hour boundary one hour of hour rollups from ``day``, a day
    boundary one day of day rollups from ``30d``. ``force_rebuild`` (or a first run) sums the range afresh.
    """
    now = now or timezone.now()
    _ensure_window_rows()
    out = {}
    for name in sorted(RANGES):
        try:
            out[name] = _advance_one(name, now, force_rebuild)
        except IntegrityError:  # a concurrent first build inserted the same rows; it holds the result
            out[name] = "unchanged"
    return out


def usage_key_ranges_rebuild(now: datetime | None = None) -> None:
    """Rebuild every range's rows from the rollups (``usage_key_ranges_advance(force_rebuild=True)``)."""
    usage_key_ranges_advance(now, force_rebuild=True)


def key_range_window_fresh(range_name: str, start: datetime, now: datetime | None = None) -> bool:
    """Whether ``UsageKeyRange`` rows of ``range_name`` may stand for the range starting at ``start``: built,
    their window starts at ``start`` or at most one bucket before it (the moments after a boundary before the
    next advance), and the advance ran within ``KEY_RANGES_MAX_AGE``."""
    if range_name not in RANGES:
        return False
    row = UsageKeyRangeWindow.objects.filter(pk=range_name).values_list("start", "advanced_at").first()
    if row is None or row[0] is None:
        return False
    step = GRANULARITY_STEP[RANGES[range_name][1]]
    now = now or timezone.now()
    return start - step <= row[0] <= start and now - row[1] <= KEY_RANGES_MAX_AGE
