"""Usage recording: async XADD on the hot path, batched idempotent flush, crash recovery (real Redis)."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import redis.asyncio as redis_async

from tenancy.models import ApiKey, Tenant
from tenancy.services import api_key_create
from usage.events import USAGE_GROUP, usage_event_emit, usage_event_emit_sync, usage_stream_key
from usage.models import UsageRecord
from usage.services import usage_dead_letter_key, usage_events_flush

pytestmark = pytest.mark.django_db


def _event(request_id: str, **extra) -> dict:
    now = time.time()
    event = {
        "request_id": request_id, "served_model_name": "qwen3-tiny", "endpoint": "chat.completions",
        "prompt_tokens": 12, "completion_tokens": 5, "cached_tokens": 3, "status_code": 200,
        "finish_reason": "stop", "ttft_ms": 41.5, "e2e_latency_ms": 120.25, "n": 1,
        "created_at": now - 0.12, "finished_at": now,
    }
    event.update(extra)
    return event


def _emit_async(redis_url: str, events: list[dict]) -> None:
    async def main():
        client = redis_async.Redis.from_url(redis_url)
        try:
            for event in events:
                await usage_event_emit(client, event)
        finally:
            await client.aclose()

    asyncio.run(main())


def test_flush_100_events_twice_gives_100_rows(redis_client, redis_url):
    tenant = Tenant.objects.create(name="t")
    api_key, _ = api_key_create(tenant=tenant, name="k")
    _emit_async(redis_url, [_event(f"req-{i}", tenant_id=tenant.pk, api_key_id=api_key.pk) for i in range(100)])
    assert redis_client.xlen(usage_stream_key()) == 100
    assert usage_events_flush(redis_client=redis_client, max_batch=64) == 64
    assert usage_events_flush(redis_client=redis_client, max_batch=64) == 36
    assert usage_events_flush(redis_client=redis_client, max_batch=64) == 0
    assert UsageRecord.objects.count() == 100
    assert redis_client.xlen(usage_stream_key()) == 0  # acked entries are deleted
    record = UsageRecord.objects.get(request_id="req-7")
    assert (record.tenant_id, record.api_key_id, record.prompt_tokens, record.completion_tokens,
            record.cached_tokens, record.status_code, record.finish_reason, record.n) == (
        tenant.pk, api_key.pk, 12, 5, 3, 200, "stop", 1)
    assert record.ttft_ms == pytest.approx(41.5) and record.e2e_latency_ms == pytest.approx(120.25)
    assert 0.1 < (record.finished_at - record.created_at).total_seconds() < 0.2
    assert ApiKey.objects.get(pk=api_key.pk).last_used_at is not None


def test_same_request_id_twice_gives_one_row(redis_client, redis_url):
    _emit_async(redis_url, [_event("dup-1"), _event("dup-1", completion_tokens=99)])
    assert usage_events_flush(redis_client=redis_client) == 2
    _emit_async(redis_url, [_event("dup-1")])  # re-delivered later, in another batch
    assert usage_events_flush(redis_client=redis_client) == 1
    assert UsageRecord.objects.filter(request_id="dup-1").count() == 1
    assert UsageRecord.objects.get(request_id="dup-1").completion_tokens == 5  # the first one wins


def test_killed_consumer_entries_are_claimed(redis_client):
    for i in range(5):
        usage_event_emit_sync(redis_client, _event(f"lost-{i}"))
    # a consumer reads the entries, then dies before writing and acknowledging them
    redis_client.xgroup_create(usage_stream_key(), USAGE_GROUP, id="0", mkstream=True)
    taken = redis_client.xreadgroup(USAGE_GROUP, "dead-host-1", {usage_stream_key(): ">"}, count=100)
    assert len(taken[0][1]) == 5
    assert usage_events_flush(redis_client=redis_client, consumer="alive-1") == 0  # not idle long enough
    assert usage_events_flush(redis_client=redis_client, consumer="alive-1", claim_idle_ms=0) == 5
    assert UsageRecord.objects.filter(request_id__startswith="lost-").count() == 5
    assert redis_client.xpending(usage_stream_key(), USAGE_GROUP)["pending"] == 0


def test_invalid_entries_go_to_dead_letter_and_do_not_block(redis_client):
    redis_client.xadd(usage_stream_key(), {"e": b"\xc1 not msgpack"})
    redis_client.xadd(usage_stream_key(), {"e": msgpack.packb({"no_request_id": 1})})
    usage_event_emit_sync(redis_client, _event("good-1"))
    assert usage_events_flush(redis_client=redis_client) == 3
    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == ["good-1"]
    assert redis_client.xlen(usage_dead_letter_key()) == 2
    assert redis_client.xpending(usage_stream_key(), USAGE_GROUP)["pending"] == 0
    with pytest.raises(ValueError):
        usage_event_emit_sync(redis_client, {"request_id": ""})


def test_deleted_key_and_long_request_id(redis_client):
    tenant = Tenant.objects.create(name="gone")
    api_key, _ = api_key_create(tenant=tenant, name="k")
    long_id = "x" * 400
    usage_event_emit_sync(redis_client, _event(long_id, tenant_id=tenant.pk, api_key_id=api_key.pk))
    usage_event_emit_sync(redis_client, _event(long_id))
    tenant.delete()  # cascades to the key
    assert usage_events_flush(redis_client=redis_client) == 2
    record = UsageRecord.objects.get()
    assert record.request_id.startswith("sha256:") and len(record.request_id) == 71
    assert record.tenant_id is None and record.api_key_id is None


def test_celery_task_flushes(redis_client, redis_url, settings):
    from usage import tasks

    settings.REDIS_URL = redis_url
    tasks._redis_client.cache_clear()
    try:
        for i in range(30):
            usage_event_emit_sync(redis_client, _event(f"task-{i}"))
        result = tasks.flush_usage_events.apply(kwargs={"max_batch": 7})
        assert result.successful() and result.result == 30
    finally:
        tasks._redis_client.cache_clear()
    assert UsageRecord.objects.count() == 30


def test_flush_rolls_up_new_rows_once_and_matches_the_catch_up_rollup(redis_client):
    from usage.models import UsageRollup
    from usage.rollups import usage_rollup_all

    tenant = Tenant.objects.create(name="r")
    api_key, _ = api_key_create(tenant=tenant, name="k")
    events = [_event(f"roll-{i}", tenant_id=tenant.pk, api_key_id=api_key.pk, status_code=429 if i % 10 == 0 else 200,
                     ttft_ms=None if i % 10 == 0 else 10.0 + i) for i in range(50)]
    for event in events:
        usage_event_emit_sync(redis_client, event)
    assert usage_events_flush(redis_client=redis_client) == 50
    for event in events[:5]:  # re-delivered: no new rows, nothing added to the rollups
        usage_event_emit_sync(redis_client, event)
    assert usage_events_flush(redis_client=redis_client) == 5
    assert not UsageRecord.objects.filter(rolled_up=False).exists()
    assert usage_rollup_all() == 0  # the flush rolled them up already
    fields = ("granularity", "bucket_start", "requests", "prompt_tokens", "completion_tokens", "cached_tokens",
              "status_429", "ttft_count", "ttft_hist", "e2e_hist")
    by_flush = sorted(UsageRollup.objects.filter(api_key_id=api_key.pk).values_list(*fields))
    assert [row[2] for row in by_flush] == [50, 50, 50] and all(row[6] == 5 and row[7] == 45 for row in by_flush)

    # the same records rolled up by the catch-up path give the same rows
    UsageRollup.objects.all().delete()
    UsageRecord.objects.update(rolled_up=False)
    assert usage_rollup_all() == 50
    assert sorted(UsageRollup.objects.filter(api_key_id=api_key.pk).values_list(*fields)) == by_flush


def test_nul_in_text_fields_never_breaks_the_batch(redis_client):
    # PostgreSQL text cannot hold U+0000: one such value would fail the whole batch's INSERT on every retry. Stored
    # as U+FFFD on every backend (D-175); the batch's other records are written with it.
    usage_event_emit_sync(redis_client, _event("before-1"))
    usage_event_emit_sync(redis_client, _event("nul\x00id", served_model_name="m\x00odel", endpoint="chat\x00",
                                               finish_reason="st\x00p"))
    usage_event_emit_sync(redis_client, _event("after-1"))
    assert usage_events_flush(redis_client=redis_client) == 3
    assert set(UsageRecord.objects.values_list("request_id", flat=True)) == {"before-1", "nul\ufffdid", "after-1"}
    record = UsageRecord.objects.get(request_id="nul\ufffdid")
    assert (record.served_model_name, record.endpoint, record.finish_reason) == ("m\ufffdodel", "chat\ufffd",
                                                                                 "st\ufffdp")
    assert redis_client.xpending(usage_stream_key(), USAGE_GROUP)["pending"] == 0
