"""Rollups (exactly once, incremental, late records) and ``GET /api/v1/usage`` (tenant isolation)."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest
from rest_framework.test import APIClient

from tenancy.models import Tenant
from tenancy.services import api_key_create
from usage.histogram import hist_quantile
from usage.models import UsageRecord, UsageRollup
from usage.rollups import usage_rollup_all, usage_rollup_run
from usage.selectors import usage_series

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 28, 10, 0, tzinfo=timezone.utc)


def _rec(i, key, minute, status=200, finish="stop", prompt=10, completion=5, ttft=50.0, e2e=200.0):
    at = T0 + timedelta(minutes=minute, seconds=i % 60)
    return UsageRecord(request_id=f"r-{key.pk}-{i}", tenant_id=key.tenant_id, api_key_id=key.pk,
                       served_model_name="m", prompt_tokens=prompt, completion_tokens=completion, status_code=status,
                       finish_reason=finish, ttft_ms=ttft, e2e_latency_ms=e2e, created_at=at,
                       finished_at=at + timedelta(milliseconds=e2e))


@pytest.fixture
def keys():
    a, b = Tenant.objects.create(name="a"), Tenant.objects.create(name="b")
    ka, pa = api_key_create(tenant=a, name="ka", scopes=["usage:read"])
    kb, pb = api_key_create(tenant=b, name="kb", scopes=["usage:read"])
    return ka, pa, kb, pb


def test_rollups_are_exact_incremental_and_idempotent(keys):
    ka, _, kb, _ = keys
    rng = random.Random(1)
    ttfts = [rng.uniform(10, 500) for _ in range(300)]
    recs = [_rec(i, ka, minute=i // 100, ttft=ttfts[i]) for i in range(300)]
    recs += [_rec(1000 + i, ka, 0, status=429, finish="", ttft=None, completion=0) for i in range(7)]
    recs += [_rec(2000 + i, ka, 1, status=503, finish="", ttft=None, completion=0) for i in range(3)]
    recs += [_rec(3000 + i, ka, 2, status=200, finish="error") for i in range(2)]
    recs += [_rec(4000 + i, ka, 2, status=200, finish="abort", completion=2) for i in range(4)]
    recs += [_rec(5000 + i, kb, 0) for i in range(11)]
    UsageRecord.objects.bulk_create(recs)
    assert usage_rollup_run(max_records=100) == 100  # incremental: batches
    assert usage_rollup_all(max_records=100) == len(recs) - 100
    assert usage_rollup_all() == 0  # nothing left: a re-run adds nothing
    for gran, count in (("minute", 3), ("hour", 1), ("day", 1)):
        rows = UsageRollup.objects.filter(granularity=gran, api_key_id=ka.pk)
        assert rows.count() == count
        assert sum(r.requests for r in rows) == 316
        assert sum(r.prompt_tokens for r in rows) == 3160
        assert sum(r.completion_tokens for r in rows) == 5 * 302 + 2 * 4
        assert (sum(r.status_429 for r in rows), sum(r.status_503 for r in rows), sum(r.errors for r in rows),
                sum(r.aborted for r in rows)) == (7, 3, 2, 4)
    day = UsageRollup.objects.get(granularity="day", api_key_id=ka.pk)
    exact = sorted(ttfts + [50.0] * 6)
    assert day.ttft_count == 306
    p50, p95 = hist_quantile(day.ttft_hist, 0.5), hist_quantile(day.ttft_hist, 0.95)
    assert abs(p50 - exact[152]) / exact[152] < 0.1 and abs(p95 - exact[290]) / exact[290] < 0.1

    # a late record (flushed after its minute was rolled up) lands in its own old bucket, once
    UsageRecord.objects.bulk_create([_rec(9999, ka, 0)])
    assert usage_rollup_all() == 1
    assert UsageRollup.objects.get(granularity="minute", api_key_id=ka.pk, bucket_start=T0).requests == 100 + 7 + 1
    assert UsageRollup.objects.get(granularity="day", api_key_id=ka.pk).requests == 317


def test_series_totals_and_empty_buckets(keys):
    ka, _, _, _ = keys
    UsageRecord.objects.bulk_create([_rec(i, ka, minute=(i % 3) * 2) for i in range(30)])
    usage_rollup_all()
    s = usage_series(granularity="minute", start=T0, end=T0 + timedelta(minutes=6), tenant_id=ka.tenant_id)
    assert [p["requests"] for p in s["points"]] == [10, 0, 10, 0, 10, 0]
    assert s["totals"]["requests"] == 30 and s["totals"]["total_tokens"] == 450
    assert s["points"][0]["ttft_p50_ms"] == pytest.approx(50, rel=0.1)


def test_usage_api_isolation(keys):
    ka, pa, kb, pb = keys
    UsageRecord.objects.bulk_create([_rec(i, ka, 0) for i in range(5)] + [_rec(100 + i, kb, 0) for i in range(9)])
    usage_rollup_all()
    ca, cb = APIClient(), APIClient()
    ca.credentials(HTTP_AUTHORIZATION=f"Bearer {pa}")
    cb.credentials(HTTP_AUTHORIZATION=f"Bearer {pb}")
    q = {"start": T0.isoformat(), "end": (T0 + timedelta(hours=1)).isoformat(), "granularity": "minute"}
    ra = ca.get("/api/v1/usage", q)
    assert ra.status_code == 200 and ra.json()["totals"]["requests"] == 5
    assert cb.get("/api/v1/usage", q).json()["totals"]["requests"] == 9
    # tenant a asking for tenant b's key: 404, never b's figures
    r = ca.get("/api/v1/usage", {**q, "api_key_id": kb.pk})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert ca.get("/api/v1/usage", {**q, "api_key_id": ka.pk}).json()["totals"]["requests"] == 5
    # a tenant parameter is ignored for API keys: the credential decides
    assert ca.get("/api/v1/usage", {**q, "tenant": kb.tenant_id}).json()["totals"]["requests"] == 5
    grouped = ca.get("/api/v1/usage", {**q, "group_by": "key"}).json()
    assert set(grouped["groups"]) == {str(ka.pk)}
    assert ca.get("/api/v1/usage", {**q, "granularity": "week"}).status_code == 400
    assert ca.get("/api/v1/usage", {"range": "30d"}).json()["granularity"] == "day"
    _, inference_only = api_key_create(tenant=ka.tenant, name="inf")
    ci = APIClient()
    ci.credentials(HTTP_AUTHORIZATION=f"Bearer {inference_only}")
    assert ci.get("/api/v1/usage", q).status_code == 403


def test_usage_api_reads_bounds_with_any_offset_in_utc(keys):
    """An offset PostgreSQL cannot store (-20:29, beyond +-15:59) or one of no whole hour is read in UTC:
    200 on every database (the CI's schemathesis run found a 500 on PostgreSQL), buckets on UTC boundaries,
    and the same records counted as with the UTC spelling of the same instants."""
    ka, pa, _, _ = keys
    UsageRecord.objects.bulk_create([_rec(i, ka, 0) for i in range(5)])
    usage_rollup_all()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {pa}")
    far = timezone(-timedelta(hours=20, minutes=29))
    start, end = (T0 - timedelta(minutes=31)).astimezone(far), (T0 + timedelta(hours=2)).astimezone(far)
    r = client.get("/api/v1/usage", {"start": start.isoformat(), "end": end.isoformat(), "granularity": "hour",
                                     "group_by": "model"})
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["start"] == "2026-11-28T09:00:00Z" and body["end"] == "2026-11-28T12:00:00Z"
    assert [p["t"] for p in body["points"]] == ["2026-11-28T09:00:00Z", "2026-11-28T10:00:00Z",
                                                "2026-11-28T11:00:00Z"]
    assert body["totals"]["requests"] == 5 and body["groups"]["m"]["requests"] == 5
    utc = client.get("/api/v1/usage", {"start": (T0 - timedelta(minutes=31)).isoformat(),
                                       "end": (T0 + timedelta(hours=2)).isoformat(), "granularity": "hour",
                                       "group_by": "model"})
    assert utc.json() == body  # the same instants spelled in UTC: the same answer
    # a start far in the future with such an offset (the case the fuzzer sent): no points, not a 500
    r = client.get("/api/v1/usage", {"start": "3547-06-14T06:04:17-20:29", "granularity": "hour",
                                     "group_by": "model"})
    assert r.status_code == 200 and r.json()["points"] == [] and r.json()["totals"]["requests"] == 0
