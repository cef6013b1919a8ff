"""Real Redis for tests: the URL (``REDIS_URL``, else db 9 of a local server) and per-test key prefixes that are
deleted afterwards (``harness.redis_keys``)."""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from typing import Iterator

import redis

from harness.redis_keys import delete_prefix

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


@contextmanager
def fresh_prefix(label: str, url: str = TEST_REDIS_URL) -> Iterator[str]:
    """A key prefix ``label-<random hex>`` unique to the test; its keys are deleted on exit."""
    value = f"{label}-{uuid.uuid4().hex[:10]}"
    try:
        yield value
    finally:
        delete_prefix(url, value)
