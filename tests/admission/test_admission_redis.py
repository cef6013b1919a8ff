"""``inference.api.admission`` against a real Redis: the Lua check-and-reserve, releases, settle, reaping."""

from __future__ import annotations

import asyncio
import os

import pytest
import redis
import redis.asyncio as aioredis

from inference.api import admission as adm
from inference.api.admission import Admission, AdmissionRefused
from tests.support.redis import fresh_prefix

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/11")
M = "m1"


@pytest.fixture
def prefix():
    with fresh_prefix("admtest", REDIS_URL) as value:
        yield value


@pytest.fixture
def sync_r():
    return redis.Redis.from_url(REDIS_URL)


async def make(prefix) -> Admission:
    a = Admission(redis=aioredis.Redis.from_url(REDIS_URL), prefix=prefix)
    a.start()
    return a


def state(sync_r, prefix):
    s = adm.model_snapshot(sync_r, prefix, M)
    return s["queued_reqs"], s["queued_tokens"]


async def test_reqs_limit_boundary_and_n(prefix, sync_r):
    adm.limits_publish(sync_r, prefix, M, 4, None)
    a = await make(prefix)
    try:
        r1 = await a.reserve(M, "a", 3, 10)
        r2 = await a.reserve(M, "b", 1, 10)  # 3 + 1 == 4: equal is admitted
        assert state(sync_r, prefix) == (4, 40)
        with pytest.raises(AdmissionRefused) as ei:
            await a.reserve(M, "c", 1, 10)  # one more is refused
        assert ei.value.reason == "max_num_queued_reqs" and "max_num_queued_reqs is 4" in ei.value.message
        assert ei.value.retry_after_s >= 1
        await a.release(r2)
        with pytest.raises(AdmissionRefused):
            await a.reserve(M, "d", 2, 10)  # n counts n: 3 + 2 > 4
        r3 = await a.reserve(M, "e", 1, 10)
        assert state(sync_r, prefix) == (4, 40)
        await a.release(r1)
        await a.release(r1)  # idempotent
        await a.release(r3)
        assert state(sync_r, prefix) == (0, 0)
        snap = adm.model_snapshot(sync_r, prefix, M)
        assert snap["refused"] == {"max_num_queued_reqs": 2, "max_num_queued_tokens": 0, "priority_tier": 0,
                                   "fair_share": 0}
    finally:
        await a.close()


async def test_tokens_limit_boundary_idle_rule_and_prefill_release(prefix, sync_r):
    adm.limits_publish(sync_r, prefix, M, None, 100)
    a = await make(prefix)
    try:
        big = await a.reserve(M, "big", 1, 500)  # idle queue: always admissible, even above the limit
        with pytest.raises(AdmissionRefused) as ei:
            await a.reserve(M, "x", 1, 1)  # backlog 500 > 100
        assert ei.value.reason == "max_num_queued_tokens" and "max_num_queued_tokens is 100" in ei.value.message
        await a.release_prefill(big, 0)
        await a.release_prefill(big, 0)  # once only
        assert state(sync_r, prefix) == (1, 0)
        r1 = await a.reserve(M, "r1", 2, 30)  # idle tokens again: 60
        r2 = await a.reserve(M, "r2", 1, 40)  # 60 + 40 == 100 admitted (own tokens count)
        with pytest.raises(AdmissionRefused):
            await a.reserve(M, "r3", 1, 1)  # 101 refused
        await a.release_prefill(r1, 1, ttft_s=0.3, phases={"frontend": 0.004, "queue": 0.2, "prefill": 0.06,
                                                            "unknown": 1.0})
        assert state(sync_r, prefix) == (4, 70)
        await a.release(r1)  # releases child 0's remaining 30 tokens and both slots
        assert state(sync_r, prefix) == (2, 40)
        await a.release_prefill(r1, 0)  # after release: no-op
        await a.release(r2)
        await a.release(big)
        assert state(sync_r, prefix) == (0, 0)
        snap = adm.model_snapshot(sync_r, prefix, M)
        assert snap["ttft_count"] == 1 and sum(snap["ttft_buckets"]) == 1
        assert snap["ttft_buckets"][adm.TTFT_BUCKETS_S.index(0.5)] == 1
        # the phases of that TTFT, each in its own histogram (finer buckets); an unknown phase is ignored
        lat = snap["latency"]
        assert set(lat) == set(adm.LATENCY_PHASES)
        for phase, seconds, bound in (("frontend", 0.004, 0.005), ("queue", 0.2, 0.25), ("prefill", 0.06, 0.1)):
            assert lat[phase]["count"] == 1 and lat[phase]["sum"] == pytest.approx(seconds)
            assert lat[phase]["buckets"][adm.PHASE_BUCKETS_S.index(bound)] == 1 and sum(lat[phase]["buckets"]) == 1
        assert not sync_r.exists(adm.latency_key(prefix, M, "unknown"))
    finally:
        await a.close()


async def test_precheck_then_settle(prefix, sync_r):
    adm.limits_publish(sync_r, prefix, M, None, 100)
    a = await make(prefix)
    try:
        other = await a.reserve(M, "o", 1, 10)
        prov = await a.precheck(M, "p", 2, 45)  # 10 + 90 == 100
        assert prov.provisional and state(sync_r, prefix) == (3, 100)
        with pytest.raises(AdmissionRefused):
            await a.precheck(M, "q", 1, 1)
        await a.reserve(M, "p", 2, 20, reservation=prov)  # shrink to 2 x 20
        assert not prov.provisional and state(sync_r, prefix) == (3, 50)
        prov2 = await a.precheck(M, "p2", 1, 10)
        with pytest.raises(AdmissionRefused):  # grows past the estimate and no longer fits: released
            await a.reserve(M, "p2", 1, 60, reservation=prov2)
        assert prov2.released and state(sync_r, prefix) == (3, 50)
        await a.release(prov)
        await a.release(other)
        assert state(sync_r, prefix) == (0, 0)
    finally:
        await a.close()


async def test_limit_change_applies_at_once_and_unbounded(prefix, sync_r):
    a = await make(prefix)
    try:
        held = [await a.reserve(M, f"u{i}", 1, 1000) for i in range(5)]  # unbounded by default
        adm.limits_publish(sync_r, prefix, M, 5, None)
        with pytest.raises(AdmissionRefused):
            await a.reserve(M, "x", 1, 1)
        adm.limits_publish(sync_r, prefix, M, 6, None)
        held.append(await a.reserve(M, "y", 1, 1))
        adm.limits_publish(sync_r, prefix, M, 0, None)  # 0 = drain: refuse everything
        for r in held:
            await a.release(r)
        with pytest.raises(AdmissionRefused):
            await a.reserve(M, "z", 1, 1)
        assert state(sync_r, prefix) == (0, 0)
    finally:
        await a.close()


async def test_concurrent_burst_never_over_admits(prefix, sync_r):
    adm.limits_publish(sync_r, prefix, M, 7, 1000)
    clients = [await make(prefix) for _ in range(4)]
    try:
        async def one(i):
            try:
                return await clients[i % 4].reserve(M, f"b{i}", 1 + i % 2, 100)
            except AdmissionRefused:
                return None
        got = [r for r in await asyncio.gather(*(one(i) for i in range(200))) if r]
        reqs, toks = state(sync_r, prefix)
        assert reqs == sum(r.n for r in got) <= 7
        assert toks == sum(r.n * 100 for r in got) <= 1000
        assert got
        for r in got:
            await clients[0].release(r)  # any process may release (the reservation is in Redis)
        assert state(sync_r, prefix) == (0, 0)
    finally:
        for c in clients:
            await c.close()


async def test_expired_holder_is_reaped(prefix, sync_r, monkeypatch):
    monkeypatch.setattr(adm, "LEASE_TTL_S", 0.5)
    a = Admission(redis=aioredis.Redis.from_url(REDIS_URL), prefix=prefix)  # never started: no lease refresh
    b = await make(prefix)
    try:
        res = await a.reserve(M, "dead", 3, 10)
        live = await b.reserve(M, "live", 1, 10)
        assert state(sync_r, prefix) == (4, 40)
        for _ in range(40):
            await asyncio.sleep(0.1)
            if state(sync_r, prefix) == (1, 10):
                break
        assert state(sync_r, prefix) == (1, 10)  # b's lease loop reaped a's reservation, kept its own
        await a.release(res)  # a late release of a reaped reservation is a no-op
        await b.release(live)
        assert state(sync_r, prefix) == (0, 0)
    finally:
        await b.close()
        await a.redis.aclose()


def test_retry_after():
    assert adm.retry_after_for(0, 0.0) == 1
    assert adm.retry_after_for(1000, 400.0) == 3
    assert adm.retry_after_for(10**9, 1.0) == adm.RETRY_AFTER_MAX_S
    assert adm.estimate_prompt_tokens(10, 512) == 26 and adm.estimate_prompt_tokens(10**6, 512) == 512
