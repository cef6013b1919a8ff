"""Usage at scale for the operator dashboard's test and bench (issue 17): 100,000 API keys and 1,000,000 usage
records, built in seconds on SQLite or PostgreSQL, with their rollups.

- Tenants and keys: ``bulk_create`` (keys get prefixes ``sk-N.......`` and a dummy hash: they never authenticate).
- Records: generated here and written by ``usage.record_insert.usage_rows_insert`` (the flush's own fast path:
  ``unnest`` of typed arrays on PostgreSQL, multi-row ``VALUES`` on SQLite), ``rolled_up = True``.
- Rollups: ``UsageRollup`` and ``UsageTotal`` rows made by the database itself, one ``INSERT ... SELECT ... GROUP
  BY`` per granularity (Django's ``Trunc``), histograms assembled as JSON text from per-bucket counts. Records take
  their TTFT and e2e latency from a few fixed values (``TTFT_MS``, ``E2E_MS``), so the buckets are known.
  ``tests/usage/test_dashboard_scale.py`` checks on a small build that these rows equal what ``usage_rollup_all``
  makes of the same records.
- Per-key range totals (``UsageKeyRange``): rebuilt from those rollups (``usage.key_ranges``), as the first
  advance of a running platform does.

Traffic: key ``HEAVY`` (0..99, in creation order) sends ``(HEAVY - i) * HEAVY_STEP`` records, so the top keys and
their order are known; the rest is spread evenly over every other key (about 7.5 each at full size, never as many
as the lightest heavy key). One record in ten is in the last hour, the rest over the last 28 days.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from django.db import connection, transaction
from django.db.models import Case, CharField, Count, IntegerField, Q, Sum, Value, When
from django.db.models.functions import Cast, Concat, Trunc

from tenancy.models import ApiKey, Tenant
from usage.histogram import EDGES, bucket_of
from usage.key_ranges import usage_key_ranges_rebuild
from usage.models import GRANULARITIES, UsageKeyRange, UsageRecord, UsageRollup, UsageTotal
from usage.record_insert import UsageRow, usage_rows_insert

HEAVY = 100
HEAVY_STEP = 50
TTFT_MS = (20.0, 60.0, 150.0, 400.0)
E2E_MS = (200.0, 700.0, 1500.0, 3000.0, 5000.0)
MODELS = ("tiny-qwen3", "all-MiniLM-L6-v2")


@dataclass
class ScaleData:
    """What was built: ids in creation order (``key_ids[i]`` is key ``i``), ``now`` of the build."""

    tenant_ids: list[int]
    key_ids: list[int]
    records: int
    now: datetime
    seconds: dict[str, float] = field(default_factory=dict)  # per phase: keys, records, rollups


# block b (HEAVY_STEP records each) of the heavy part belongs to key _HEAVY_BLOCKS[b]: key h owns HEAVY - h blocks
_HEAVY_BLOCKS = [h for h in range(HEAVY) for _ in range(HEAVY - h)]


def _key_index(i: int, heavy_records: int, heavy_step: int, keys: int) -> int:
    """Key (index) of record ``i``: the heavy keys' records first, then the rest spread over the others."""
    if i < heavy_records:
        return _HEAVY_BLOCKS[i // heavy_step]
    return HEAVY + ((i - heavy_records) * 7919) % (keys - HEAVY)


def _rows(records: int, keys: int, key_ids: list[int], tenant_of: list[int], now: datetime, start: int, stop: int,
          heavy_step: int):
    heavy = min(records, len(_HEAVY_BLOCKS) * heavy_step) if keys > HEAVY else 0
    span_s = 28 * 86400
    for i in range(start, stop):
        k = _key_index(i, heavy, heavy_step, keys) if heavy else i % keys
        offset = (i * 7919) % 3500 + 5 if i % 10 == 0 else (i * 104729) % span_s + 3600
        created = now - timedelta(seconds=offset)
        status = 429 if i % 97 == 0 else (503 if i % 89 == 0 else (500 if i % 211 == 0 else 200))
        e2e = E2E_MS[i % len(E2E_MS)]
        yield UsageRow(f"scale-{i}", tenant_of[k], key_ids[k], MODELS[1] if i % 7 == 0 else MODELS[0],
                       "chat.completions", 100 + i % 50, 20 + i % 30, i % 3, status,
                       "stop" if status == 200 else ("abort" if i % 13 == 0 else ""), TTFT_MS[i % len(TTFT_MS)],
                       e2e, 1, created, created + timedelta(milliseconds=e2e))


def _hist_sql(field: str, values: tuple[float, ...]):
    """A ``Concat`` making the JSON list of a histogram of ``field`` whose values are among ``values``."""
    buckets = {bucket_of(v) for v in values}
    parts: list = []
    text = "["
    for b in range(max(buckets) + 1):
        sep = "," if b else ""
        if b in buckets:
            parts.append(Value(text + sep))
            text = ""
            count = Sum(Case(When(**{f"{field}__gte": EDGES[b], f"{field}__lt": EDGES[b + 1]}, then=1),
                             default=0, output_field=IntegerField()))
            parts.append(Cast(count, CharField()))
        else:
            text += sep + "0"
    parts.append(Value(text + "]"))
    return Concat(*parts, output_field=CharField())


def _figures() -> dict:
    errors = (Q(status_code__gte=400) & ~Q(status_code__in=(429, 499, 503))) | Q(finish_reason="error")

    def count_if(cond):
        return Sum(Case(When(cond, then=1), default=0, output_field=IntegerField()))

    return {"f_requests": Count("id"), "f_prompt": Sum("prompt_tokens"), "f_completion": Sum("completion_tokens"),
            "f_cached": Sum("cached_tokens"), "f_429": count_if(Q(status_code=429)),
            "f_503": count_if(Q(status_code=503)), "f_errors": count_if(errors),
            "f_aborted": count_if(Q(finish_reason="abort")), "f_ttft_count": Count("ttft_ms"),
            "f_ttft_sum": Sum("ttft_ms"), "f_e2e_sum": Sum("e2e_latency_ms"),
            "f_ttft_hist": _hist_sql("ttft_ms", TTFT_MS), "f_e2e_hist": _hist_sql("e2e_latency_ms", E2E_MS)}


_FIGURE_COLUMNS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "status_429", "status_503",
                   "errors", "aborted", "ttft_count", "ttft_sum_ms", "e2e_sum_ms", "ttft_hist", "e2e_hist")


def rollups_from_records() -> None:
    """Make the ``UsageRollup`` and ``UsageTotal`` rows of every record, in SQL (replaces existing rows)."""
    qn = connection.ops.quote_name
    figure_aliases = list(_figures())
    json_cast = "CAST({} AS jsonb)" if connection.vendor == "postgresql" else "{}"
    UsageRollup.objects.all().delete()
    UsageTotal.objects.all().delete()
    for model, group in ((UsageRollup, ("api_key_id", "tenant_id")), (UsageTotal, ())):
        for gran in GRANULARITIES:
            qs = (UsageRecord.objects.order_by().annotate(b=Trunc("created_at", gran, tzinfo=timezone.utc))
                  .values("b", "served_model_name", *group).annotate(**_figures()))
            sub_sql, params = qs.query.sql_with_params()
            cols = ["granularity", "bucket_start", "served_model_name", *group, *_FIGURE_COLUMNS]
            select = ["%s", f"sub.{qn('b')}", f"sub.{qn('served_model_name')}"]
            select += [f"COALESCE(sub.{qn(g)}, 0)" for g in group]
            for column, alias in zip(_FIGURE_COLUMNS, figure_aliases):
                expr = f"COALESCE(sub.{qn(alias)}, 0)" if not column.endswith("_hist") else f"sub.{qn(alias)}"
                select.append(json_cast.format(expr) if column.endswith("_hist") else expr)
            sql = (f"INSERT INTO {qn(model._meta.db_table)} ({', '.join(qn(c) for c in cols)}) "
                   f"SELECT {', '.join(select)} FROM ({sub_sql}) sub")
            with connection.cursor() as cur:
                cur.execute(sql, (gran, *params))


def build_usage_at_scale(*, keys: int = 100_000, tenants: int = 1_000, records: int = 1_000_000,
                         now: datetime | None = None, chunk: int = 50_000, heavy_step: int = HEAVY_STEP) -> ScaleData:
    """Build ``tenants`` tenants, ``keys`` keys (key ``i`` in tenant ``i % tenants``), ``records`` usage records
    and their rollups (see the module docstring; ``heavy_step`` records per block of a heavy key). Returns the
    ids."""
    now = now or datetime.now(timezone.utc)
    t0 = time.perf_counter()
    made = Tenant.objects.bulk_create([Tenant(name=f"scale-tenant-{i:05d}") for i in range(tenants)],
                                      batch_size=2000)
    tenant_ids = [t.pk for t in made]
    key_ids: list[int] = []
    for start in range(0, keys, 10_000):
        batch = [ApiKey(tenant_id=tenant_ids[i % tenants], name=f"svc-{i:06d}", prefix=f"sk-N{i:07d}",
                        secret_hash="0" * 64) for i in range(start, min(keys, start + 10_000))]
        key_ids += [k.pk for k in ApiKey.objects.bulk_create(batch, batch_size=2000)]
    tenant_of = [tenant_ids[i % tenants] for i in range(keys)]
    seconds = {"keys": time.perf_counter() - t0}
    t0 = time.perf_counter()
    for start in range(0, records, chunk):
        with transaction.atomic():
            rows = _rows(records, keys, key_ids, tenant_of, now, start, min(records, start + chunk), heavy_step)
            usage_rows_insert(list(rows), rolled_up=True)
    seconds["records"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with transaction.atomic():
        rollups_from_records()
    usage_key_ranges_rebuild()
    with connection.cursor() as cur:  # planner statistics, as autovacuum / a periodic ANALYZE would have them
        for model in (ApiKey, Tenant, UsageRecord, UsageRollup, UsageTotal, UsageKeyRange):
            cur.execute(f"ANALYZE {connection.ops.quote_name(model._meta.db_table)}")
    seconds["rollups"] = time.perf_counter() - t0
    return ScaleData(tenant_ids=tenant_ids, key_ids=key_ids, records=records, now=now, seconds=seconds)
