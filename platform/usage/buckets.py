"""Time buckets of the usage rollups (minute/hour/day, UTC) and the dashboards' ranges built on them.

Shared by ``usage.rollups`` (writes buckets), ``usage.key_ranges`` (per-key range totals) and
``usage.selectors`` (reads), so none of them imports another for arithmetic.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.utils import timezone


def bucket_floor(when: datetime, granularity: str) -> datetime:
    """Start of the minute/hour/day (UTC) containing the aware datetime ``when``."""
    if granularity == "minute":
        return when.replace(second=0, microsecond=0)
    if granularity == "hour":
        return when.replace(minute=0, second=0, microsecond=0)
    if granularity == "day":
        return when.replace(hour=0, minute=0, second=0, microsecond=0)
    raise ValueError(f"unknown granularity {granularity!r}")


GRANULARITY_STEP = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1), "day": timedelta(days=1)}

# Dashboard ranges: name -> (span, granularity of its buckets).
RANGES = {"hour": (timedelta(hours=1), "minute"), "day": (timedelta(days=1), "hour"),
          "30d": (timedelta(days=30), "day")}


def usage_range(range_name: str, now: datetime | None = None) -> tuple[datetime, datetime, str]:
    """``(start, end, granularity)`` of a dashboard range: ``hour`` (per minute), ``day`` (per hour) or
    ``30d`` (per day), ending after the current bucket. Raises ``ValueError`` for another name."""
    if range_name not in RANGES:
        raise ValueError(f"range must be one of {sorted(RANGES)}")
    span, gran = RANGES[range_name]
    now = now or timezone.now()
    end = bucket_floor(now, gran) + GRANULARITY_STEP[gran]
    return end - span, end, gran
