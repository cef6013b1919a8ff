"""Celery tasks of the usage app (queue ``usage``, see ``CELERY_TASK_ROUTES``)."""

from __future__ import annotations

import functools

import redis
from celery import shared_task
from django.conf import settings

from .services import usage_events_flush


@functools.lru_cache(maxsize=1)
def _redis_client() -> redis.Redis:
    """One sync client per process (redis-py resets its pool after fork)."""
    return redis.Redis.from_url(settings.REDIS_URL)


@shared_task(name="usage.flush_usage_events", acks_late=True, ignore_result=True)
def flush_usage_events(max_batch: int = 1000, max_rounds: int = 20) -> int:
    """Flush usage events into ``UsageRecord`` rows: up to ``max_rounds`` batches of ``max_batch``.

    Scheduled by beat every second; returns the number of stream entries handled.
    """
    total = 0
    for _round in range(max_rounds):
        handled = usage_events_flush(redis_client=_redis_client(), max_batch=max_batch)
        total += handled
        if handled < max_batch:
            break
    return total
