"""Per-key range totals (``usage.key_ranges``, ``UsageKeyRange``) that rank the operator's key table (issue 17).

Expected values come from the records themselves (summed here in Python per key, ``usage.rollups.record_classify``
for the status classes), never from the rollups the totals are made of. Records are written by the real writers:
the flush's path (``usage_rows_insert`` + ``usage_rollup_rows`` in one transaction) and the catch-up path
(``usage_rollup_all`` over ``rolled_up = False`` rows). Windows are moved with an explicit ``now``.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest
from django.db import transaction

from tenancy.models import ApiKey, Tenant
from usage.buckets import GRANULARITY_STEP, RANGES, usage_range
from usage.key_ranges import (
    KEY_RANGE_SUMS,
    KEY_RANGES_MAX_AGE,
    key_range_window_fresh,
    usage_key_ranges_advance,
    usage_key_ranges_rebuild,
)
from usage.models import UsageKeyRange, UsageKeyRangeWindow, UsageRecord
from usage.record_insert import UsageRow, usage_rows_insert
from usage.rollups import record_classify, usage_rollup_all, usage_rollup_rows
from usage.selectors import usage_key_table

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 28, 10, 30, 17, tzinfo=timezone.utc)


def _keys(n: int, tenants: int = 3) -> list[ApiKey]:
    ts = Tenant.objects.bulk_create([Tenant(name=f"kr-tenant-{i}") for i in range(tenants)])
    return ApiKey.objects.bulk_create([ApiKey(tenant_id=ts[i % tenants].pk, name=f"kr-key-{i:03d}",
                                              prefix=f"sk-K{i:06d}", secret_hash="0" * 64) for i in range(n)])


_seq = iter(range(10**9))


def _row(key: ApiKey | None, at: datetime, rng: random.Random) -> UsageRow:
    status = rng.choice((200, 200, 200, 200, 429, 503, 500, 499))
    return UsageRow(f"kr-{next(_seq)}", key.tenant_id if key else None, key.pk if key else None,
                    rng.choice(("m1", "m2")), "chat.completions", rng.randint(1, 300), rng.randint(0, 90),
                    0, status, "stop" if status == 200 else "", 40.0, 300.0, 1, at, at + timedelta(seconds=1))


def _flush(rows: list[UsageRow]) -> None:
    """What ``usage.services`` does with a batch: insert and roll up in one transaction."""
    with transaction.atomic():
        usage_rows_insert(rows, rolled_up=True)
        usage_rollup_rows(rows)


def _catch_up(rows: list[UsageRow]) -> None:
    """Records written without their rollups (``rolled_up = False``), then rolled up by ``usage_rollup_all``."""
    with transaction.atomic():
        usage_rows_insert(rows, rolled_up=False)
    assert usage_rollup_all(max_records=37) == len(rows)


def _truth(start: datetime) -> dict[int, tuple]:
    """``{key id: (tenant id, *KEY_RANGE_SUMS)}`` summed from the records created at or after ``start``."""
    out: dict[int, list[int]] = {}
    for r in UsageRecord.objects.filter(created_at__gte=start, api_key_id__isnull=False):
        acc = out.setdefault(r.api_key_id, [r.tenant_id, 0, 0, 0, 0, 0, 0])
        cls = record_classify(r.status_code, r.finish_reason)
        for i, v in enumerate((1, r.prompt_tokens, r.completion_tokens, cls["status_429"], cls["status_503"],
                               cls["errors"]), 1):
            acc[i] += v
    return {k: tuple(v) for k, v in out.items()}


def _table(range_name: str) -> dict[int, tuple]:
    return {r[0]: tuple(r[1:]) for r in UsageKeyRange.objects.filter(range_name=range_name)
            .values_list("api_key_id", "tenant_id", *KEY_RANGE_SUMS)}


def _assert_exact(now: datetime) -> None:
    for name in RANGES:
        start = usage_range(name, now)[0]
        assert UsageKeyRangeWindow.objects.get(pk=name).start == start
        assert _table(name) == _truth(start), name


def _spread(keys, now: datetime, n: int, rng: random.Random, max_age: timedelta) -> list[UsageRow]:
    """``n`` records of random keys (one in 20 without a key) at random times in ``[now - max_age, now]``."""
    return [_row(rng.choice(keys) if i % 20 else None, now - timedelta(seconds=rng.uniform(0, max_age.total_seconds())),
                 rng) for i in range(n)]


def test_writers_keep_the_totals_equal_to_the_records_and_windows_move_exactly():
    rng = random.Random(7)
    keys = _keys(40)
    old = _spread(keys, T0, 300, rng, timedelta(days=40))
    _flush(old[:150])
    _catch_up(old[150:])
    assert usage_key_ranges_advance(T0) == {n: "rebuilt" for n in RANGES}  # first run: built from the rollups
    _assert_exact(T0)
    assert usage_key_ranges_advance(T0) == {n: "unchanged" for n in RANGES}
    # new traffic through both writers, including late records (older buckets, some before every window)
    _flush(_spread(keys, T0, 200, rng, timedelta(days=35)))
    _catch_up(_spread(keys, T0, 100, rng, timedelta(hours=3)))
    _flush(_spread(keys, T0, 50, rng, timedelta(minutes=2)))
    _assert_exact(T0)
    # the windows slide: minutes, then hours (hour range rebuilt: moved a whole span), then days
    for later, expected in ((timedelta(minutes=3), {"hour": "advanced", "day": "unchanged", "30d": "unchanged"}),
                            (timedelta(minutes=50), {"hour": "advanced", "day": "advanced", "30d": "unchanged"}),
                            (timedelta(hours=5), {"hour": "rebuilt", "day": "advanced", "30d": "unchanged"}),
                            (timedelta(days=3), {"hour": "rebuilt", "day": "rebuilt", "30d": "advanced"})):
        now = T0 + later
        assert usage_key_ranges_advance(now) == expected, later
        _assert_exact(now)
        _flush(_spread(keys, now, 60, rng, timedelta(hours=30)))  # traffic between the moves
        _assert_exact(now)
    # no row is kept at zero: a key whose traffic all left the window has no row
    assert not UsageKeyRange.objects.filter(requests__lte=0).exists()
    usage_key_ranges_rebuild(T0 + timedelta(days=3))
    _assert_exact(T0 + timedelta(days=3))


def test_staleness_is_one_bucket_at_most_and_only_until_the_next_advance():
    rng = random.Random(3)
    keys = _keys(5, tenants=1)
    t = T0.replace(second=30)
    expiring = t - timedelta(minutes=59, seconds=10)  # in the hour window's first minute
    _flush([_row(keys[0], expiring, rng), _row(keys[1], t - timedelta(minutes=5), rng)])
    usage_key_ranges_advance(t)
    later = t + timedelta(seconds=40)  # past the minute boundary, no advance yet
    start = usage_range("hour", later)[0]
    assert start > expiring
    # one bucket behind: still used, and still counting the expired minute (D-155)
    assert key_range_window_fresh("hour", start, now=later)
    assert _table("hour")[keys[0].pk][1] == 1 and _truth(start).get(keys[0].pk) is None
    # two buckets behind, or an advance not seen for KEY_RANGES_MAX_AGE: not used
    assert not key_range_window_fresh("hour", usage_range("hour", t + timedelta(minutes=2))[0],
                                      now=t + timedelta(minutes=2))
    assert not key_range_window_fresh("hour", usage_range("hour", t)[0], now=t + KEY_RANGES_MAX_AGE
                                      + timedelta(seconds=1))
    day_start = usage_range("day", t)[0]
    assert key_range_window_fresh("day", day_start + GRANULARITY_STEP["hour"], now=t)
    assert not key_range_window_fresh("day", day_start + 2 * GRANULARITY_STEP["hour"], now=t)
    assert not key_range_window_fresh("day", day_start - GRANULARITY_STEP["hour"], now=t)  # window ahead
    # the next advance drops it
    assert usage_key_ranges_advance(later)["hour"] == "advanced"
    assert keys[0].pk not in _table("hour") and _table("hour") == _truth(start)


def _strip(table: dict) -> dict:
    return {k: v for k, v in table.items() if k != "source"}


def test_key_table_from_totals_equals_the_live_query_on_every_page():
    """Every page, range, search and tenant filter: the totals give what the live query gives (at real time;
    records kept away from the window edges so a boundary passing mid-test changes nothing)."""
    rng = random.Random(11)
    keys = _keys(57, tenants=4)  # keys 45.. get no traffic at all; key 44 only older than 30 days
    now = datetime.now(timezone.utc)
    ages = (timedelta(minutes=5), timedelta(minutes=50), timedelta(hours=3), timedelta(hours=22),
            timedelta(days=5), timedelta(days=28), timedelta(days=45))
    rows = [_row(keys[i % 44], now - ages[i % len(ages)] - timedelta(seconds=rng.uniform(0, 60)), rng)
            for i in range(700)]
    rows += [_row(keys[44], now - timedelta(days=40), rng)]
    # ties: keys 40..43 get exactly one record each in the last hour
    rows += [_row(keys[i], now - timedelta(minutes=10), rng) for i in range(40, 44)]
    _flush(rows)
    deleted = keys[3]
    deleted.delete()  # its rollups and totals stay; the table never lists it
    usage_key_ranges_advance()
    tenant = keys[1].tenant_id
    seen_sources = set()
    for range_name in RANGES:
        start, end, gran = usage_range(range_name)
        for tenant_id, q in ((None, None), (tenant, None), (None, "kr-key-01"), (None, "SK-k00004"),
                             (None, "tenant-2"), (tenant, "kr-"), (None, "nothing-like-it")):
            page, pages = 1, 1
            while page <= pages + 1:  # one past the end too
                args = dict(granularity=gran, start=start, end=end, tenant_id=tenant_id, q=q, page=page,
                            page_size=7)
                fast = usage_key_table(range_name=range_name, **args)
                slow = usage_key_table(**args)
                assert slow["source"] == "live"
                seen_sources.add(fast["source"])
                assert _strip(fast) == _strip(slow), (range_name, tenant_id, q, page)
                assert deleted.pk not in {r["id"] for r in fast["results"]}
                pages = fast["pages"]
                page += 1
        # and the order is the records' own: most requests first, then by id, idle keys last
        truth = _truth(start)
        every = [r for p in range(1, 9) for r in usage_key_table(range_name=range_name, granularity=gran,
                                                                 start=start, end=end, page=p,
                                                                 page_size=7)["results"]]  # 56 keys
        expected = sorted((k.pk for k in keys if k.pk != deleted.pk),
                          key=lambda pk: (-truth.get(pk, (0, 0))[1], pk))
        assert [r["id"] for r in every] == expected
        assert [r["requests"] for r in every] == [truth.get(pk, (0, 0))[1] for pk in expected]
    assert seen_sources == {"totals"}
    # a model filter, or totals that are not fresh, answer from the live query
    start, end, gran = usage_range("day")
    assert usage_key_table(range_name="day", granularity=gran, start=start, end=end,
                           served_model_name="m1")["source"] == "live"
    UsageKeyRangeWindow.objects.update(advanced_at=now - KEY_RANGES_MAX_AGE - timedelta(seconds=5))
    assert usage_key_table(range_name="day", granularity=gran, start=start, end=end)["source"] == "live"
