"""Per-key/per-tenant limits in real Redis: RPM, TPM reserve-then-settle, concurrency leases, budgets."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tenancy.limits import (
    LimitGrant, Limits, RateLimitExceeded, budget_period_bounds, grant_headers, limits_acquire,
    limits_settle, limits_usage, openai_duration,
)
from tests.support.limits_context import Ctx

WORKER = Path(__file__).with_name("burst_worker.py")


def _hdr(headers) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in headers}


async def test_no_limits_makes_no_redis_call(prefix):
    class Boom:
        def register_script(self, _src):
            raise AssertionError("Redis must not be touched without limits")

    grant = await limits_acquire(Boom(), prefix, Ctx(1, 1), max_tokens_reserved=100)
    assert grant.is_noop and grant_headers(grant) == []
    assert await limits_settle(Boom(), prefix, grant, actual_tokens=5) is True
    assert await limits_settle(Boom(), prefix, grant, actual_tokens=5) is False


async def test_rpm_refuses_the_sixth_with_retry_after_and_headers(aredis, prefix):
    ctx = Ctx(1, 10, key_limits=Limits(rpm=5))
    grants = [await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=10) for _ in range(5)]
    h = _hdr(grant_headers(grants[-1]))
    assert h["x-ratelimit-limit-requests"] == "5" and h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"].endswith("s") and "x-ratelimit-limit-tokens" not in h
    assert _hdr(grant_headers(grants[0]))["x-ratelimit-remaining-requests"] == "4"
    with pytest.raises(RateLimitExceeded) as exc:
        await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=10)
    err = exc.value
    assert err.reason == "key_rpm" and err.code == "rate_limit_exceeded"
    assert 11 <= err.retry_after_s <= 13  # one request refills in 60/5 = 12 s
    assert _hdr(err.headers)["retry-after"] == str(err.retry_after_s)
    for g in grants:
        await limits_settle(aredis, prefix, g, actual_tokens=1)
    with pytest.raises(RateLimitExceeded):  # settling does not give requests back
        await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=10)


async def test_tpm_reserves_max_and_settles_to_actual(aredis, prefix):
    ctx = Ctx(2, 20, key_limits=Limits(tpm=1000))
    first = await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=600)
    assert _hdr(grant_headers(first))["x-ratelimit-remaining-tokens"] == "400"
    with pytest.raises(RateLimitExceeded) as exc:
        await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=600)
    assert exc.value.reason == "key_tpm"
    assert await limits_settle(aredis, prefix, first, actual_tokens=100) is True  # 500 given back
    second = await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=600)
    remaining = int(_hdr(grant_headers(second))["x-ratelimit-remaining-tokens"])
    assert 300 <= remaining <= 310  # 1000 - 100 - 600 (+ a few tokens of refill)
    with pytest.raises(RateLimitExceeded) as exc:  # larger than the whole limit: never fits
        await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=1001)
    assert exc.value.retry_after_s == 0 and "Request too large" in exc.value.message


async def test_settle_is_idempotent_across_processes(aredis, prefix):
    ctx = Ctx(3, 30, key_limits=Limits(tpm=1000, max_concurrent=1))
    grant = await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=500)
    # another process holding a copy of the grant (e.g. a retry) settles it too: no double refund
    twin = replace(grant, settled=False, _keepalive=None)
    assert await limits_settle(aredis, prefix, grant, actual_tokens=0) is True
    assert await limits_settle(aredis, prefix, twin, actual_tokens=0) is False
    g = await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=1000)  # all 1000 back, not 1500
    assert int(_hdr(grant_headers(g))["x-ratelimit-remaining-tokens"]) <= 5


async def test_concurrency_lease_released_by_settle_and_expires_after_crash(aredis, prefix):
    ctx = Ctx(4, 40, key_limits=Limits(max_concurrent=2))
    a = await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=1, lease_ttl_s=0.6, keepalive=False)
    b = await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=1)  # default lease, renewed
    with pytest.raises(RateLimitExceeded) as exc:
        await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=1)
    assert exc.value.reason == "key_concurrency"
    assert (await limits_usage(aredis, prefix, ctx))["key"]["concurrent"] == 2
    # ``a``'s holder "crashed" (no keepalive): its lease expires; ``b`` is kept alive
    for _ in range(600):  # at most 60 s
        if (await limits_usage(aredis, prefix, ctx))["key"]["concurrent"] < 2:
            break
        await asyncio.sleep(0.1)
    assert (await limits_usage(aredis, prefix, ctx))["key"]["concurrent"] == 1
    c = await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=1)
    with pytest.raises(RateLimitExceeded):
        await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=1)
    await limits_settle(aredis, prefix, b, actual_tokens=1)
    d = await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=1)
    for g in (a, c, d):
        await limits_settle(aredis, prefix, g, actual_tokens=1)
    assert (await limits_usage(aredis, prefix, ctx))["key"]["concurrent"] == 0


async def test_budget_reserves_then_settles_and_tenant_limit_spans_keys(aredis, prefix):
    tenant = Limits(token_budget=1000, budget_period="day")
    k1, k2 = Ctx(5, 50, tenant_limits=tenant), Ctx(6, 50, tenant_limits=tenant)
    g1 = await limits_acquire(aredis, prefix, k1, max_tokens_reserved=600)
    with pytest.raises(RateLimitExceeded) as exc:  # the other key of the same tenant
        await limits_acquire(aredis, prefix, k2, max_tokens_reserved=600)
    assert exc.value.reason == "tenant_budget" and exc.value.code == "insufficient_quota"
    start, end = budget_period_bounds("day")
    assert end - time.time() - 1 <= exc.value.retry_after_s <= end - start  # until the period ends
    await limits_settle(aredis, prefix, g1, actual_tokens=150)
    assert (await limits_usage(aredis, prefix, k2))["tenant"]["budget_used"] == 150
    g2 = await limits_acquire(aredis, prefix, k2, max_tokens_reserved=600)
    await limits_settle(aredis, prefix, g2, actual_tokens=700)  # more than reserved is charged too
    assert (await limits_usage(aredis, prefix, k1))["tenant"]["budget_used"] == 850
    with pytest.raises(RateLimitExceeded):
        await limits_acquire(aredis, prefix, k1, max_tokens_reserved=151)
    await limits_settle(aredis, prefix, await limits_acquire(aredis, prefix, k1, max_tokens_reserved=150),
                        actual_tokens=150)


async def test_refusal_reserves_nothing(aredis, prefix):
    # the key allows it, the tenant does not: the key's RPM must not be consumed by the refused request
    ctx = Ctx(7, 70, key_limits=Limits(rpm=3), tenant_limits=Limits(max_concurrent=1))
    g = await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=1)
    for _ in range(5):
        with pytest.raises(RateLimitExceeded) as exc:
            await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=1)
        assert exc.value.reason == "tenant_concurrency"
    await limits_settle(aredis, prefix, g, actual_tokens=1)
    g2 = await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=1)
    assert _hdr(grant_headers(g2))["x-ratelimit-remaining-requests"] == "1"


def _burst(redis_url, prefix, procs: int, attempts: int, reserve: int, key_id: int,
           limits: tuple) -> tuple[int, int, float]:
    """Run the burst; returns ``(granted, refused, seconds from the start signal until every process ended)``
    (refills during that time may grant more)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    children = [subprocess.Popen([sys.executable, str(WORKER), redis_url, prefix, str(attempts), str(reserve),
                                  str(key_id), "1", *map(str, limits)], stdout=subprocess.PIPE, text=True)
                for _ in range(procs)]
    client.set(f"{prefix}:go", str(time.time() + 1.5))
    go = time.monotonic() + 1.5
    granted = refused = 0
    for child in children:
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0
        g, r = map(int, out.split())
        granted, refused = granted + g, refused + r
    client.close()
    return granted, refused, max(0.0, time.monotonic() - go)


def test_burst_from_four_processes_never_exceeds_the_limits(redis_url, prefix):
    # rpm, tpm, conc, budget; 4 processes x 40 concurrent attempts each, no settling
    granted, refused, took = _burst(redis_url, prefix, 4, 40, 10, 100, (25, 0, 0, 0))
    assert granted + refused == 160
    assert 25 <= granted <= 26 + int(took * 25 / 60)  # 25 + the refills (25/min) during the burst, however long
    granted, refused, _ = _burst(redis_url, prefix, 4, 40, 10, 101, (0, 0, 7, 0))
    assert granted == 7
    granted, refused, _ = _burst(redis_url, prefix, 4, 40, 100, 102, (0, 0, 0, 1050))
    assert granted == 10  # budget: 10 x 100 reserved <= 1050 < 11 x 100
    granted, refused, took = _burst(redis_url, prefix, 4, 40, 100, 103, (0, 3000, 0, 0))
    assert 30 <= granted <= 31 + int(took * 3000 / 60 / 100)  # + refills (3000 tokens/min, 100 a request)


def test_openai_duration_format():
    assert [openai_duration(s) for s in (0, 0.02, 1, 59.2, 60, 360, 3723)] == [
        "0s", "20ms", "1s", "1m0s", "1m0s", "6m0s", "1h2m3s"]
    assert openai_duration(59.2) == "1m0s"


def test_reservation_and_str_headers():
    from tenancy.limits import limits_reservation

    assert limits_reservation(100, 50, 3) == 250 and limits_reservation(10, 0) == 10
    err = RateLimitExceeded("m", 3, [(b"retry-after", b"3")])
    assert err.str_headers == [("retry-after", "3")]


def test_grant_is_a_plain_dataclass():
    assert LimitGrant(grant_id="x", key_id=1, tenant_id=1, reserved_tokens=0, lease_ttl_s=1).is_noop


async def test_killed_holder_frees_its_slot_within_ten_seconds_and_a_live_one_keeps_it(redis_url, aredis, prefix):
    """Issue 17's drill goal in small: a process holding a concurrency slot (default lease, keepalive) keeps it past
    the lease's TTL while it lives, and once it is ``kill -9``-ed its slot is free within ``LEASE_TTL_S`` (≤ 10 s),
    not 30 s as before (DECISIONS D-181)."""
    from tenancy.limits import LEASE_TTL_S

    assert LEASE_TTL_S <= 8
    ctx = Ctx(8, 8, key_limits=Limits(max_concurrent=1))
    holder = subprocess.Popen([sys.executable, str(Path(__file__).with_name("lease_holder.py")), redis_url, prefix,
                               "8"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        await asyncio.sleep(LEASE_TTL_S * 1.5)  # past the first lease: only the keepalive keeps it
        assert (await limits_usage(aredis, prefix, ctx))["key"]["concurrent"] == 1
        with pytest.raises(RateLimitExceeded):
            await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=1, keepalive=False)
    finally:
        holder.kill()
        holder.wait()
    killed = time.monotonic()
    while (await limits_usage(aredis, prefix, ctx))["key"]["concurrent"] and time.monotonic() - killed < 20:
        await asyncio.sleep(0.1)
    freed_s = time.monotonic() - killed
    assert freed_s <= LEASE_TTL_S + 0.5 and freed_s < 10, freed_s
    g = await limits_acquire(aredis, prefix, ctx, max_tokens_reserved=1, keepalive=False)
    await limits_settle(aredis, prefix, g, actual_tokens=1)
