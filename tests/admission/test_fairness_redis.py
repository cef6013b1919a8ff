"""Tenant-fair admission and priority tiers in the admission script, against a real Redis (docs/ARCHITECTURE.md §3)."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from inference.api import admission as adm
from inference.api.admission import Admission, AdmissionRefused
from tests.admission.test_admission_redis import REDIS_URL, make
from tests.support.redis import fresh_prefix

M = "fair-m"


@pytest.fixture
def prefix():
    with fresh_prefix("admfair", REDIS_URL) as value:
        yield value


@pytest.fixture
def sync_r():
    return redis.Redis.from_url(REDIS_URL)


def tenants(sync_r, prefix) -> dict:
    return adm.model_snapshot(sync_r, prefix, M)["tenants"]


def wsum(sync_r, prefix) -> int:
    return int(sync_r.hget(adm.state_key(prefix, M), "wsum") or 0)


async def test_tenant_over_its_share_is_refused_at_the_soft_threshold(prefix, sync_r):
    adm.limits_publish(sync_r, prefix, M, None, 1000, fair_share_threshold_pct=50)
    a = await make(prefix)
    try:
        # A alone may fill past the threshold (its share is the whole limit while nobody else queues)
        held_a = [await a.reserve(M, f"a{i}", 1, 100, tenant="A") for i in range(6)]
        assert [r.fair_rank for r in held_a] == [1, 2, 3, 4, 5, 6]  # 10 × held / share (the whole 1000, alone)
        # B holds nothing: admitted although the model is above the threshold
        held_b = [await a.reserve(M, "b0", 1, 100, tenant="B")]
        assert held_b[0].fair_rank == 2  # 100 of its 500: the engine runs it before A's backlog
        # A holds 600 > its half (500): refused, though 300 tokens of the limit are free
        with pytest.raises(AdmissionRefused) as ei:
            await a.reserve(M, "a-more", 1, 100, tenant="A")
        assert ei.value.reason == "fair_share" and ei.value.limit == 500 and ei.value.measure == "tokens"
        assert "holds 600 queued prompt tokens" in ei.value.message and ei.value.retry_after_s >= 1
        # B, within its share, finds the room A was kept out of, up to the hard limit
        held_b += [await a.reserve(M, f"b{i}", 1, 100, tenant="B") for i in range(1, 4)]
        with pytest.raises(AdmissionRefused) as ei:
            await a.reserve(M, "b-over", 1, 100, tenant="B")
        assert ei.value.reason == "max_num_queued_tokens"
        t = tenants(sync_r, prefix)
        assert t["A"] == {"queued_reqs": 6, "queued_tokens": 600, "weight": 1, "admitted": 6, "refused": 1}
        assert t["B"] == {"queued_reqs": 4, "queued_tokens": 400, "weight": 1, "admitted": 4, "refused": 1}
        assert wsum(sync_r, prefix) == 2
        # A's first tokens arrive: its prompt tokens leave its count, its requests stay
        for r in held_a[:3]:
            await a.release_prefill(r, 0)
        assert tenants(sync_r, prefix)["A"]["queued_tokens"] == 300
        await a.reserve(M, "a-again", 1, 100, tenant="A")  # 400 ≤ 500: within its share again
        for r in held_a + held_b:
            await a.release(r)
        t = tenants(sync_r, prefix)
        assert t["A"]["queued_reqs"] == 1 and t["B"] == {"queued_reqs": 0, "queued_tokens": 0, "weight": 0,
                                                          "admitted": 4, "refused": 1}
        assert wsum(sync_r, prefix) == 1  # B left the active set with its last reservation
    finally:
        await a.close()


async def test_weights_divide_the_limit(prefix, sync_r):
    adm.limits_publish(sync_r, prefix, M, 8, None, fair_share_threshold_pct=25)
    a = await make(prefix)
    try:
        await a.reserve(M, "b0", 1, 10, tenant="B", weight=1)
        heavy = [await a.reserve(M, f"h{i}", 1, 10, tenant="H", weight=3) for i in range(6)]  # 3/4 of 8
        with pytest.raises(AdmissionRefused) as ei:
            await a.reserve(M, "h-more", 1, 10, tenant="H", weight=3)
        assert ei.value.reason == "fair_share" and ei.value.limit == 6 and ei.value.measure == "reqs"
        await a.reserve(M, "b1", 1, 10, tenant="B", weight=1)  # 2 = 1/4 of 8
        with pytest.raises(AdmissionRefused) as ei:
            await a.reserve(M, "b2", 1, 10, tenant="B", weight=1)
        assert ei.value.reason == "max_num_queued_reqs"
        # a weight changed while the tenant is active is in force at its next request
        for r in heavy[:3]:
            await a.release(r)
        assert wsum(sync_r, prefix) == 4
        await a.reserve(M, "h-w1", 1, 10, tenant="H", weight=1)  # share 1/2 of 8 = 4: H holds 4 now
        assert wsum(sync_r, prefix) == 2
        with pytest.raises(AdmissionRefused) as ei:
            await a.reserve(M, "h-w1b", 1, 10, tenant="H", weight=1)
        assert ei.value.reason == "fair_share" and ei.value.limit == 4
    finally:
        await a.close()


async def test_first_come_first_served_when_the_threshold_is_100(prefix, sync_r):
    adm.limits_publish(sync_r, prefix, M, 4, None)  # fairness off (the default)
    a = await make(prefix)
    try:
        for i in range(3):
            await a.reserve(M, f"a{i}", 1, 10, tenant="A")
        await a.reserve(M, "b0", 1, 10, tenant="B")
        with pytest.raises(AdmissionRefused) as ei:  # the next comer is refused, whoever it is
            await a.reserve(M, "b1", 1, 10, tenant="B")
        assert ei.value.reason == "max_num_queued_reqs"
    finally:
        await a.close()


async def test_tier_ceilings_refuse_the_lowest_tier_first(prefix, sync_r):
    ceilings = adm.tier_ceilings_pct(high_tier_reserve_pct=20, low_tier_ceiling_pct=50)
    assert ceilings == {0: 100, 1: 80, 2: 50}
    adm.limits_publish(sync_r, prefix, M, 10, None, tier_ceilings=ceilings)
    a = await make(prefix)
    try:
        for i in range(5):
            await a.reserve(M, f"l{i}", 1, 10, tenant="L", tier=adm.TIER_LOW)
        with pytest.raises(AdmissionRefused) as ei:
            await a.reserve(M, "l5", 1, 10, tenant="L", tier=adm.TIER_LOW)
        assert ei.value.reason == "priority_tier" and ei.value.limit == 5 and "'low' priority tier" in ei.value.message
        for i in range(3):
            await a.reserve(M, f"s{i}", 1, 10, tenant="S", tier=adm.TIER_STANDARD)
        with pytest.raises(AdmissionRefused) as ei:
            await a.reserve(M, "s3", 1, 10, tenant="S", tier=adm.TIER_STANDARD)
        assert ei.value.reason == "priority_tier" and ei.value.limit == 8
        for i in range(2):  # the reserve is the high tier's
            await a.reserve(M, f"h{i}", 1, 10, tenant="H", tier=adm.TIER_HIGH)
        with pytest.raises(AdmissionRefused) as ei:
            await a.reserve(M, "h2", 1, 10, tenant="H", tier=adm.TIER_HIGH)
        assert ei.value.reason == "max_num_queued_reqs"
        snap = adm.model_snapshot(sync_r, prefix, M)
        assert snap["refused"]["priority_tier"] == 2 and snap["tier_ceilings_pct"] == ceilings
    finally:
        await a.close()


async def test_settle_moves_the_tenants_tokens(prefix, sync_r):
    adm.limits_publish(sync_r, prefix, M, None, 1000, fair_share_threshold_pct=50)
    a = await make(prefix)
    try:
        res = await a.precheck(M, "p", 2, 300, tenant="A")
        assert tenants(sync_r, prefix)["A"]["queued_tokens"] == 600
        await a.reserve(M, "p", 2, 40, reservation=res)
        assert tenants(sync_r, prefix)["A"]["queued_tokens"] == 80
        await a.release_prefill(res, 1)
        assert tenants(sync_r, prefix)["A"]["queued_tokens"] == 40
        await a.release(res)
        assert tenants(sync_r, prefix)["A"]["queued_reqs"] == 0 and wsum(sync_r, prefix) == 0
    finally:
        await a.close()


async def test_concurrent_burst_of_two_tenants_keeps_the_well_behaved_one_in(prefix, sync_r):
    """Many concurrent reserves from a greedy tenant and a few from a modest one: the greedy one never holds
    more than the threshold once the modest one queues, and every modest request is admitted."""
    adm.limits_publish(sync_r, prefix, M, 20, None, fair_share_threshold_pct=50)
    procs = [await make(prefix) for _ in range(3)]
    try:
        await procs[0].reserve(M, "m-first", 1, 10, tenant="modest")

        async def one(i: int, tenant: str):
            try:
                return await procs[i % 3].reserve(M, f"{tenant}{i}", 1, 10, tenant=tenant)
            except AdmissionRefused as exc:
                return exc

        out = await asyncio.gather(*[one(i, "greedy") for i in range(60)], *[one(i, "modest") for i in range(5)])
        greedy, modest = out[:60], out[60:]
        assert all(not isinstance(r, AdmissionRefused) for r in modest)
        assert sum(not isinstance(r, AdmissionRefused) for r in greedy) == 10  # its half of 20
        assert {r.reason for r in greedy if isinstance(r, AdmissionRefused)} == {"fair_share"}
        assert adm.model_snapshot(sync_r, prefix, M)["queued_reqs"] == 16
    finally:
        for p in procs:
            await p.close()


async def test_reaper_corrects_the_tenant_counters(prefix, sync_r, monkeypatch):
    monkeypatch.setattr(adm, "LEASE_TTL_S", 0.5)
    adm.limits_publish(sync_r, prefix, M, 10, None, fair_share_threshold_pct=50)
    dead = Admission(redis=aioredis.Redis.from_url(REDIS_URL), prefix=prefix)  # never started: no lease refresh
    live = await make(prefix)
    try:
        await dead.reserve(M, "d", 3, 10, tenant="A", weight=2)
        kept = await live.reserve(M, "l", 1, 10, tenant="B")
        assert wsum(sync_r, prefix) == 3
        for _ in range(40):
            await asyncio.sleep(0.1)
            if tenants(sync_r, prefix)["A"]["queued_reqs"] == 0:
                break
        t = tenants(sync_r, prefix)
        assert t["A"]["queued_reqs"] == 0 and t["A"]["queued_tokens"] == 0 and t["A"]["weight"] == 0
        assert t["B"]["queued_reqs"] == 1 and wsum(sync_r, prefix) == 1
        await live.release(kept)
        assert wsum(sync_r, prefix) == 0 and adm.model_snapshot(sync_r, prefix, M)["queued_reqs"] == 0
    finally:
        await live.close()
        await dead.redis.aclose()


async def test_a_take_sent_twice_counts_once(prefix, sync_r):
    """redis-py re-sends a script whose reply timed out: the same reservation taken again changes nothing."""
    adm.limits_publish(sync_r, prefix, M, 10, None, fair_share_threshold_pct=50)
    a = await make(prefix)
    try:
        res = await a.precheck(M, "twice", 2, 30, tenant="A")
        await a._take(res)  # the re-sent script
        assert adm.model_snapshot(sync_r, prefix, M)["queued_reqs"] == 2
        assert tenants(sync_r, prefix)["A"]["admitted"] == 1 and tenants(sync_r, prefix)["A"]["queued_tokens"] == 60
        await a.release(res)
        assert adm.model_snapshot(sync_r, prefix, M)["queued_reqs"] == 0 and wsum(sync_r, prefix) == 0
    finally:
        await a.close()


def test_engine_priority_stays_within_the_tier():
    assert adm.engine_priority(adm.TIER_HIGH) == 0
    assert adm.engine_priority(adm.TIER_STANDARD, 5) == adm.TIER_STRIDE + 5
    assert adm.engine_priority(adm.TIER_HIGH, 10**12) == adm.RANK_STRIDE - 1 < adm.engine_priority(adm.TIER_HIGH, 0, 1)
    top = adm.engine_priority(adm.TIER_HIGH, 10**12, 10**6)  # whatever the rank and the wish: still the high tier
    assert top == adm.FAIR_RANK_MAX * adm.RANK_STRIDE + adm.RANK_STRIDE - 1 < adm.engine_priority(adm.TIER_STANDARD)
    assert adm.engine_priority(adm.TIER_LOW, -3) == 2 * adm.TIER_STRIDE
