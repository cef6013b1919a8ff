"""The control plane's sync Redis client for admission state (one per URL per process)."""

from __future__ import annotations

import functools

import redis
from django.conf import settings


@functools.lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def redis_client() -> redis.Redis:
    """The control plane's sync Redis client (``settings.REDIS_URL``)."""
    return _client(settings.REDIS_URL)
