"""Real Redis for tests: the URL (``REDIS_URL``, else db 9 of a local server) and per-test key prefixes that are
deleted afterwards."""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from typing import Iterator

import redis

TEST_REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/9"


def redis_or_skip(url: str = TEST_REDIS_URL) -> redis.Redis:
    """A client of the Redis at ``url``; the calling test is skipped when it does not answer."""
    import pytest

    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.RedisError as exc:
        client.close()
        pytest.skip(f"no Redis at {url}: {exc}")
    return client


def delete_matching(url: str, pattern: str) -> None:
    """Delete every key matching the glob ``pattern`` (Redis ``SCAN MATCH`` syntax) in the Redis at ``url``."""
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=pattern, count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key under ``prefix:`` in the Redis at ``url``."""
    delete_matching(url, f"{prefix}:*")


@contextmanager
def fresh_prefix(label: str, url: str = TEST_REDIS_URL) -> Iterator[str]:
    """A key prefix ``label-<random hex>`` unique to the test; its keys are deleted on exit."""
    value = f"{label}-{uuid.uuid4().hex[:10]}"
    try:
        yield value
    finally:
        delete_prefix(url, value)
