"""Celery tasks of the usage app (queue ``usage``, see ``CELERY_TASK_ROUTES``)."""

from __future__ import annotations

import functools

import redis
from celery import shared_task
from django.conf import settings

from .key_ranges import usage_key_ranges_advance
from .live import usage_live_notify
from .rollups import usage_rollup_all
from .services import usage_events_flush


@functools.lru_cache(maxsize=1)
def _redis_client() -> redis.Redis:
    """One sync client per process (redis-py resets its pool after fork)."""
    return redis.Redis.from_url(settings.REDIS_URL)


# Events per transaction. Each batch pays ~a dozen round trips and one commit whatever its size;
# bench/usage.py measured 16-17k events/s at 1,000 per batch and 22-23k at 5,000 on a 2-core box.
FLUSH_BATCH = 5000


@shared_task(name="usage.flush_usage_events", acks_late=True, ignore_result=True)
def flush_usage_events(max_batch: int = FLUSH_BATCH, max_rounds: int = 20) -> int:
    """Flush usage events into ``UsageRecord`` rows: up to ``max_rounds`` batches of ``max_batch``.

    Scheduled by beat every second; returns the number of stream entries handled. When it wrote records
    it also rolls them up at once (``usage.rollups``), so dashboards lag the traffic by about a second
    even where beat has no ``usage.rollup_usage`` entry. Every run, with or without events, then moves the
    per-key range totals to the current windows (``usage.key_ranges.usage_key_ranges_advance``; one read per
    range unless a bucket boundary passed), which bounds their staleness by this task's period (D-155).
    """
    total = 0
    for _round in range(max_rounds):
        handled = usage_events_flush(redis_client=_redis_client(), max_batch=max_batch)
        total += handled
        if handled < max_batch:
            break
    if total:
        usage_rollup_all()
    usage_key_ranges_advance()
    if total:
        _notify_dashboards()
    return total


@shared_task(name="usage.rollup_usage", acks_late=True, ignore_result=True)
def rollup_usage(max_records: int = 5000, max_rounds: int = 20) -> int:
    """Add not-yet-rolled-up ``UsageRecord`` rows to the minute/hour/day ``UsageRollup`` rows (idempotent).

    For beat (queue ``usage``); returns the number of records added.
    """
    added = usage_rollup_all(max_records=max_records, max_rounds=max_rounds)
    usage_key_ranges_advance()
    if added:
        _notify_dashboards()
    return added


def _notify_dashboards() -> None:
    """Tell live dashboards (Channels group ``usage.live``) that new rollups exist; never raises."""
    try:
        usage_live_notify()
    except Exception:  # noqa: BLE001 - a dashboard ping must never fail a flush
        pass
