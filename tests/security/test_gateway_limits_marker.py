"""Issue 14: a settled grant's marker expires in minutes (``SETTLED_MARKER_TTL_S``), not a day, and still makes
settling idempotent while it lives. Real Redis (``REDIS_URL`` or db 9), a random key prefix."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import redis.asyncio as redis_async

from tenancy.limits import LEASE_TTL_S, SETTLED_MARKER_TTL_S, Limits, limits_acquire, limits_settle
from tests.support.redis import TEST_REDIS_URL, fresh_prefix

REDIS_URL = TEST_REDIS_URL


@dataclass
class Ctx:
    key_id: int
    tenant_id: int
    key_limits: Limits
    tenant_limits: Limits


@pytest.fixture
def prefix():
    with fresh_prefix("sec-marker") as value:
        yield value


def test_default_marker_ttl_is_minutes_and_outlives_a_lease():
    assert LEASE_TTL_S <= SETTLED_MARKER_TTL_S <= 15 * 60


@pytest.mark.asyncio
async def test_settled_marker_expires_in_minutes(prefix):
    client = redis_async.Redis.from_url(REDIS_URL)
    try:
        ctx = Ctx(1, 1, Limits(max_concurrent=2, tpm=1000), Limits())
        grant = await limits_acquire(client, prefix, ctx, max_tokens_reserved=10, keepalive=False)
        assert await limits_settle(client, prefix, grant, actual_tokens=3) is True
        ttl = await client.ttl(f"{prefix}:lim:settled:{grant.grant_id}")
        assert 0 < ttl <= SETTLED_MARKER_TTL_S <= 15 * 60
        # while it lives, a second settle of the same grant (another process's copy of it) does nothing
        twin = await limits_acquire(client, prefix, ctx, max_tokens_reserved=10, keepalive=False)
        twin.grant_id = grant.grant_id
        assert await limits_settle(client, prefix, twin, actual_tokens=3) is False
        other = await limits_acquire(client, prefix, ctx, max_tokens_reserved=10, keepalive=False)
        assert await limits_settle(client, prefix, other, actual_tokens=0, marker_ttl_s=45) is True
        assert 0 < await client.ttl(f"{prefix}:lim:settled:{other.grant_id}") <= 45
    finally:
        await client.aclose()
