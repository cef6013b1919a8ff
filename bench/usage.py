"""Usage benchmark (issue 5): ingestion into PostgreSQL, dashboard query from rollups, limits overhead.

Prints, in one run:

1. Usage ingestion: events/s through the real batched path (Redis stream -> ``usage_events_flush`` with the
   flush task's batch size: XREADGROUP, decode, one ``INSERT ... SELECT unnest(...) ON CONFLICT DO NOTHING``,
   the minute/hour/day rollups of the new rows, ``last_used_at``, commit, XACK+XDEL) versus one INSERT per
   event (``UsageRecord.save()`` in autocommit, no rollups), same events, same database; the ratio.
   Goal >= 10x and >= 5,000 events/s.
2. Dashboard query: ``N`` records (default 1,000,000) for one key spread over 30 days, rolled up by the real
   ``usage_rollup_all``; p50/p95 of ``dashboard_payload`` for the last 30 days / day / hour. Goal p50 <= 100 ms.
3. Limits overhead: p50/p99 of ``limits_acquire`` + ``limits_settle`` with key and tenant limits (RPM, TPM,
   concurrency, budget) against real Redis, versus the same calls with no limits (no Redis round trip).
   Goal p50 <= 1 ms.

Usage::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test REDIS_URL=redis://127.0.0.1:6379/15 \\
        .venv/bin/python bench/usage.py [--records 1000000] [--events 20000] [--single 2000]

A scratch database ``bench_usage_<pid>`` is created on the PostgreSQL server and dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import statistics
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "platform"), str(REPO)]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _scratch_db(url: str) -> tuple[str, str]:
    """Create a scratch database next to ``url``'s; returns (new url, name)."""
    import psycopg

    name = f"bench_usage_{os.getpid()}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    base = url.rsplit("/", 1)[0]
    return f"{base}/{name}", name


def _drop_db(url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _event(i: int, tenant_id: int, key_id: int, now: float) -> dict:
    return {"request_id": f"bench-{uuid.uuid4().hex}-{i}", "tenant_id": tenant_id, "api_key_id": key_id,
            "served_model_name": "tiny-qwen3", "endpoint": "chat.completions", "prompt_tokens": 100 + i % 50,
            "completion_tokens": 20 + i % 30, "cached_tokens": 0, "status_code": 200, "finish_reason": "stop",
            "ttft_ms": 40.0 + i % 100, "e2e_latency_ms": 300.0 + i % 500, "n": 1, "created_at": now - 0.3,
            "finished_at": now}


def _profiler():
    """A running cProfile profiler when BENCH_PROFILE is set, else None."""
    if not os.environ.get("BENCH_PROFILE"):
        return None
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    return prof


def _profile_print(prof) -> None:
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def bench_ingest(n_batched: int, n_single: int, tenant, key, redis_client) -> dict:
    from usage.events import usage_event_encode, usage_stream_key, EVENT_FIELD
    from usage.models import UsageRecord
    from usage.services import usage_events_flush, usage_record_from_event
    from usage.tasks import FLUSH_BATCH

    now = time.time()
    pipe = redis_client.pipeline(transaction=False)
    for i in range(n_batched):
        pipe.xadd(usage_stream_key(), {EVENT_FIELD: usage_event_encode(_event(i, tenant.pk, key.pk, now))})
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()
    t0 = time.perf_counter()
    done = 0
    prof = _profiler()
    for _ in range(n_batched):  # bounded
        handled = usage_events_flush(redis_client=redis_client, max_batch=FLUSH_BATCH, consumer="bench")
        done += handled
        if handled == 0:
            break
    batched_s = time.perf_counter() - t0
    _profile_print(prof)
    assert done == n_batched and UsageRecord.objects.count() == n_batched, (done, UsageRecord.objects.count())

    events = [_event(n_batched + i, tenant.pk, key.pk, now) for i in range(n_single)]
    t0 = time.perf_counter()
    for ev in events:
        usage_record_from_event(ev).save()
    single_s = time.perf_counter() - t0
    return {"batched_eps": n_batched / batched_s, "single_eps": n_single / single_s}


def bench_dashboard(n_records: int, tenant, key) -> dict:
    from django.db import connection

    from usage.models import UsageRecord, UsageRollup
    from usage.rollups import usage_rollup_all
    from usage.web import dashboard_payload

    from usage.selectors import usage_range

    UsageRecord.objects.all().delete()
    UsageRollup.objects.all().delete()  # the ingestion part's rows are rolled up already
    now = datetime.now(timezone.utc)
    start, _end, _gran = usage_range("30d", now)
    span = (now - start).total_seconds() - 1
    buf = io.StringIO()
    cols = ("request_id", "tenant_id", "api_key_id", "served_model_name", "endpoint", "prompt_tokens",
            "completion_tokens", "cached_tokens", "status_code", "finish_reason", "ttft_ms", "e2e_latency_ms", "n",
            "created_at", "finished_at", "rolled_up")
    t0 = time.perf_counter()
    for i in range(n_records):
        at = now - timedelta(seconds=span * (i + 0.5) / n_records)
        status = 429 if i % 97 == 0 else (503 if i % 89 == 0 else 200)
        buf.write("\t".join(map(str, (
            f"d-{i}", tenant.pk, key.pk, "tiny-qwen3", "chat.completions", 100 + i % 50, 20 + i % 30, 0, status,
            "stop" if status == 200 else "", 20.0 + (i * 7919) % 500, 200.0 + (i * 104729) % 3000, 1,
            at.isoformat(), (at + timedelta(milliseconds=300)).isoformat(), "f"))) + "\n")
    with connection.cursor() as cur:
        with cur.connection.cursor().copy(
                f"COPY usage_usagerecord ({', '.join(cols)}) FROM STDIN") as copy:
            copy.write(buf.getvalue())
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    prof = _profiler()
    rolled = usage_rollup_all(max_records=20_000, max_rounds=10_000)
    _profile_print(prof)
    rollup_s = time.perf_counter() - t0
    assert rolled == n_records, rolled
    out = {"load_s": load_s, "rollup_s": rollup_s, "rollup_eps": n_records / rollup_s}
    for rng in ("30d", "day", "hour"):
        times = []
        for _ in range(21):
            t0 = time.perf_counter()
            data = dashboard_payload(range_name=rng, tenant_id=tenant.pk, api_key_id=key.pk)
            times.append((time.perf_counter() - t0) * 1000)
        out[f"{rng}_p50_ms"] = statistics.median(times)
        out[f"{rng}_p95_ms"] = _pct(times, 0.95)
        if rng == "30d":
            out["30d_requests"] = data["totals"]["requests"]
    return out


async def bench_limits(redis_url: str, rounds: int) -> dict:
    import redis.asyncio as redis_async

    from tenancy.limits import Limits, limits_acquire, limits_settle
    from tenancy.selectors import AuthContext

    prefix = f"benchlim-{uuid.uuid4().hex[:8]}"
    client = redis_async.Redis.from_url(redis_url)
    big = 10 ** 9
    limited = AuthContext(key_id=1, key_prefix="sk-x", tenant_id=1, tenant_name="t", allowed_models=(),
                          scopes=("inference",), expires_at=None,
                          key_limits=Limits(rpm=big, tpm=big, max_concurrent=1000, token_budget=big * 1000,
                                            budget_period="day"),
                          tenant_limits=Limits(rpm=big, tpm=big, max_concurrent=1000))
    free = AuthContext(key_id=2, key_prefix="sk-y", tenant_id=2, tenant_name="u", allowed_models=(),
                       scopes=("inference",), expires_at=None)

    async def run(ctx) -> list[float]:
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            grant = await limits_acquire(client, prefix, ctx, max_tokens_reserved=600)
            await limits_settle(client, prefix, grant, actual_tokens=150)
            times.append((time.perf_counter() - t0) * 1000)
        return times

    await run(limited)  # warm up (script load, connections)
    on = await run(limited)
    off = await run(free)
    keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
    if keys:
        await client.delete(*keys)
    await client.aclose()
    return {"on_p50_ms": statistics.median(on), "on_p99_ms": _pct(on, 0.99), "off_p50_ms": statistics.median(off),
            "extra_p50_ms": statistics.median(on) - statistics.median(off)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--single", type=int, default=2_000)
    ap.add_argument("--limit-rounds", type=int, default=2_000)
    args = ap.parse_args()
    base_url = os.environ.get("DATABASE_URL") or "postgres://postgres@127.0.0.1:5432/test"
    redis_url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/15"
    os.environ["REDIS_URL"] = redis_url
    scratch_url, name = _scratch_db(base_url)
    os.environ["DATABASE_URL"] = scratch_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ["LINK_PREFIX"] = f"benchusage{uuid.uuid4().hex[:8]}"
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    try:
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        import redis

        from tenancy.models import Tenant
        from tenancy.services import api_key_create

        tenant = Tenant.objects.create(name="bench")
        key, _ = api_key_create(tenant=tenant, name="bench")
        r = redis.Redis.from_url(redis_url)

        print(f"== usage ingestion into PostgreSQL ({args.events} batched events, {args.single} single inserts)")
        ing = bench_ingest(args.events, args.single, tenant, key, r)
        print(f"batched (stream -> insert+rollup):{ing['batched_eps']:10.0f} events/s")
        print(f"one insert per event:            {ing['single_eps']:10.0f} events/s")
        print(f"ratio: {ing['batched_eps'] / ing['single_eps']:.1f}x   (goal >= 10x and >= 5,000 events/s)")

        print(f"\n== dashboard query over {args.records:,} records, one key, 30 days (from rollups)")
        dash = bench_dashboard(args.records, tenant, key)
        print(f"COPY load {dash['load_s']:.1f} s; rollup {dash['rollup_s']:.1f} s ({dash['rollup_eps']:.0f} records/s)")
        print(f"30-day range (per day):  p50 {dash['30d_p50_ms']:.2f} ms  p95 {dash['30d_p95_ms']:.2f} ms  "
              f"(requests shown: {dash['30d_requests']:,})")
        print(f"1-day range (per hour):  p50 {dash['day_p50_ms']:.2f} ms  p95 {dash['day_p95_ms']:.2f} ms")
        print(f"1-hour range (per min):  p50 {dash['hour_p50_ms']:.2f} ms  p95 {dash['hour_p95_ms']:.2f} ms")
        print("goal: p50 <= 100 ms")

        print(f"\n== limits overhead ({args.limit_rounds} acquire+settle, key + tenant limits, real Redis)")
        lim = asyncio.run(bench_limits(redis_url, args.limit_rounds))
        print(f"limits on:  p50 {lim['on_p50_ms']:.3f} ms  p99 {lim['on_p99_ms']:.3f} ms")
        print(f"limits off: p50 {lim['off_p50_ms']:.3f} ms")
        print(f"extra p50:  {lim['extra_p50_ms']:.3f} ms   (goal <= 1 ms)")
        keys = list(r.scan_iter(match=f"{os.environ['LINK_PREFIX']}:*", count=1000))
        if keys:
            r.delete(*keys)
    finally:
        from django.db import connections

        connections.close_all()
        _drop_db(base_url, name)


if __name__ == "__main__":
    main()
