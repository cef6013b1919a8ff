"""Fixtures for the tenancy tests: real Redis (``REDIS_URL`` or db 9) under a per-test key prefix."""

from __future__ import annotations

import pytest
import pytest_asyncio
import redis.asyncio as redis_async

from tests.support.redis import TEST_REDIS_URL, fresh_prefix


@pytest.fixture
def redis_url() -> str:
    return TEST_REDIS_URL


@pytest.fixture
def prefix(redis_url):
    """A key prefix unique to the test; its keys are deleted afterwards."""
    with fresh_prefix("limtest", redis_url) as value:
        yield value


@pytest_asyncio.fixture(loop_scope="function")
async def aredis(redis_url):
    client = redis_async.Redis.from_url(redis_url)
    await client.ping()
    yield client
    await client.aclose()
