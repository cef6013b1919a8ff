"""Issue 39: a request with an output constraint costs every decode step a token mask (a tenant's 16 constrained rows
slowed another tenant's decode by 30 %), so it counts as ``STRUCTURED_FAIR_SHARE_WEIGHT`` requests in its tenant's
fair share of the admission limits, and in its fair rank; the model's own request count is unchanged. Real Redis,
the real admission scripts."""

from __future__ import annotations

import pytest
import redis

from inference.api import admission as adm
from inference.api.admission import AdmissionRefused
from tests.admission.test_admission_redis import REDIS_URL, make
from tests.support.redis import fresh_prefix

M = "fair-constrained"


@pytest.fixture
def prefix():
    with fresh_prefix("admcons", REDIS_URL) as value:
        yield value


async def test_constrained_requests_weigh_more_in_their_tenants_share(prefix):
    sync_r = redis.Redis.from_url(REDIS_URL)
    adm.limits_publish(sync_r, prefix, M, 10, None, fair_share_threshold_pct=25)
    a = await make(prefix)
    held = []
    try:
        held.append(await a.precheck(M, "b0", 1, 10, tenant="B"))  # B active: A's share is half of 10
        held += [await a.precheck(M, f"a{i}", 1, 10, tenant="A", fair_cost=2) for i in range(2)]
        snap = adm.model_snapshot(sync_r, prefix, M)
        assert snap["tenants"]["A"]["queued_reqs"] == 4  # two constrained requests hold four of A's share
        assert int(sync_r.hget(adm.state_key(prefix, M), "reqs")) == 3  # the model's own count: three requests
        with pytest.raises(AdmissionRefused) as refused:  # a third: 4 + 2 > 5; a plain one still fits (4 + 1)
            await a.precheck(M, "a2", 1, 10, tenant="A", fair_cost=2)
        assert refused.value.reason == "fair_share"
        plain = await a.precheck(M, "a3", 1, 10, tenant="A")
        assert plain.fair_rank > held[1].fair_rank  # constrained rows pushed A further into its share
        held.append(plain)
        for r in held:
            await a.release(r)
        after = adm.model_snapshot(sync_r, prefix, M)
        assert after["tenants"].get("A", {}).get("queued_reqs", 0) == 0  # released by what was counted, exactly
        assert int(sync_r.hget(adm.state_key(prefix, M), "reqs")) == 0
        assert int(sync_r.hget(adm.state_key(prefix, M), "wsum") or 0) == 0
    finally:
        await a.close()
