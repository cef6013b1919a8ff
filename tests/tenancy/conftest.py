"""Fixtures for the tenancy tests: real Redis (``REDIS_URL`` or db 9) under a per-test key prefix."""

from __future__ import annotations

import os
import uuid

import pytest
import pytest_asyncio
import redis
import redis.asyncio as redis_async


@pytest.fixture
def redis_url() -> str:
    return os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/9"


@pytest.fixture
def prefix(redis_url):
    """A key prefix unique to the test; its keys are deleted afterwards."""
    value = f"limtest-{uuid.uuid4().hex[:10]}"
    yield value
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{value}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest_asyncio.fixture(loop_scope="function")
async def aredis(redis_url):
    client = redis_async.Redis.from_url(redis_url)
    await client.ping()
    yield client
    await client.aclose()
