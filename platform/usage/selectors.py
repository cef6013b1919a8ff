"""Usage reads for the REST API and the dashboards, from ``UsageRollup``/``UsageTotal`` rows only (never the raw
records).

``usage_series`` returns one point per bucket of the chosen granularity (empty buckets included, so charts
have a continuous time axis) plus totals over the range. Figures per point: requests, prompt/completion/
cached tokens, 429 and 503 counts, errors, aborted, error rate, TTFT p50/p95 and mean, e2e p50/p95/mean.
All tenants and keys together (the operator's charts) come from ``UsageTotal`` (one row per bucket and model).
``usage_key_table`` is the operator's key table: every key, top traffic first, searched and paginated in SQL.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any, Iterable

from django.db import connection
from django.db.models import Q, Sum
from django.utils import timezone

from tenancy.models import ApiKey

from .histogram import hist_add, hist_quantile
from .models import GRANULARITIES, UsageRollup, UsageTotal
from .rollups import GRANULARITY_STEP, bucket_floor

RANGES = {"hour": (timedelta(hours=1), "minute"), "day": (timedelta(days=1), "hour"),
          "30d": (timedelta(days=30), "day")}
MAX_POINTS = 2000

_SUMS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "status_429", "status_503", "errors",
         "aborted", "ttft_count", "ttft_sum_ms", "e2e_sum_ms")


def _empty() -> dict[str, Any]:
    acc: dict[str, Any] = {f: 0 for f in _SUMS}
    acc["ttft_hist"], acc["e2e_hist"] = [], []
    return acc


def _finish(acc: dict[str, Any]) -> dict[str, Any]:
    req = acc["requests"]
    out = {f: acc[f] for f in ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "status_429",
                               "status_503", "errors", "aborted")}
    out["total_tokens"] = acc["prompt_tokens"] + acc["completion_tokens"]
    out["error_rate"] = round(acc["errors"] / req, 6) if req else 0.0

    def r(v):
        return None if v is None else round(v, 3)

    out["ttft_p50_ms"] = r(hist_quantile(acc["ttft_hist"], 0.5))
    out["ttft_p95_ms"] = r(hist_quantile(acc["ttft_hist"], 0.95))
    out["ttft_mean_ms"] = r(acc["ttft_sum_ms"] / acc["ttft_count"]) if acc["ttft_count"] else None
    out["e2e_p50_ms"] = r(hist_quantile(acc["e2e_hist"], 0.5))
    out["e2e_p95_ms"] = r(hist_quantile(acc["e2e_hist"], 0.95))
    out["e2e_mean_ms"] = r(acc["e2e_sum_ms"] / req) if req else None
    return out


def usage_rollup_rows(*, granularity: str, start: datetime, end: datetime, tenant_id: int | None = None,
                      api_key_ids: Iterable[int] | None = None, served_model_name: str | None = None):
    """Rollup rows of ``granularity`` with ``start <= bucket_start < end``, filtered by tenant, keys, model.

    ``tenant_id=None`` means every tenant (operators only); ``api_key_ids=None`` every key of the tenant.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}")
    qs = UsageRollup.objects.filter(granularity=granularity, bucket_start__gte=start, bucket_start__lt=end)
    if tenant_id is not None:
        qs = qs.filter(tenant_id=tenant_id)
    if api_key_ids is not None:
        qs = qs.filter(api_key_id__in=list(api_key_ids))
    if served_model_name:
        qs = qs.filter(served_model_name=served_model_name)
    return qs


def usage_series(*, granularity: str, start: datetime, end: datetime, tenant_id: int | None = None,
                 api_key_ids: Iterable[int] | None = None, served_model_name: str | None = None,
                 group_by: str | None = None) -> dict[str, Any]:
    """Usage over ``[start, end)`` per ``granularity`` bucket: ``{"granularity", "start", "end", "points":
    [{"t": iso, ...figures}], "totals": {...figures}, "groups": {...}}``.

    ``start`` is floored to the granularity; at most ``MAX_POINTS`` buckets (``ValueError`` beyond); ``end`` not
    after ``start``: no points, zero totals.
    ``group_by`` ``"key"`` or ``"model"`` adds per-group totals under ``groups``.
    """
    start = bucket_floor(start, granularity)
    step = GRANULARITY_STEP[granularity]
    if (end - start) / step > MAX_POINTS:
        raise ValueError(f"range too long for granularity {granularity} (more than {MAX_POINTS} points)")
    if tenant_id is None and api_key_ids is None and group_by != "key":
        rows = UsageTotal.objects.filter(granularity=granularity, bucket_start__gte=start, bucket_start__lt=end)
        if served_model_name:
            rows = rows.filter(served_model_name=served_model_name)
        fields: tuple[str, ...] = ("bucket_start", "served_model_name", *_SUMS, "ttft_hist", "e2e_hist")
    else:
        rows = usage_rollup_rows(granularity=granularity, start=start, end=end, tenant_id=tenant_id,
                                 api_key_ids=api_key_ids, served_model_name=served_model_name)
        fields = ("bucket_start", "api_key_id", "served_model_name", *_SUMS, "ttft_hist", "e2e_hist")
    buckets: dict[datetime, dict[str, Any]] = defaultdict(_empty)
    total = _empty()
    groups: dict[Any, dict[str, Any]] = defaultdict(_empty)
    for row in rows.values_list(*fields):
        values = dict(zip(fields, row))
        targets = [buckets[values["bucket_start"]], total]
        if group_by == "key":
            targets.append(groups[values["api_key_id"]])
        elif group_by == "model":
            targets.append(groups[values["served_model_name"]])
        for acc in targets:
            for f in _SUMS:
                acc[f] += values[f]
            hist_add(acc["ttft_hist"], values["ttft_hist"])
            hist_add(acc["e2e_hist"], values["e2e_hist"])
    points = []
    t = start
    for _ in range(MAX_POINTS + 1):
        if t >= end:
            break
        point = _finish(buckets.get(t) or _empty())
        point["t"] = t.isoformat().replace("+00:00", "Z")
        points.append(point)
        t += step
    return {
        "granularity": granularity,
        "start": start.isoformat().replace("+00:00", "Z"),
        "end": end.isoformat().replace("+00:00", "Z"),
        "points": points,
        "totals": _finish(total),
        "groups": {str(k): _finish(v) for k, v in groups.items()} if group_by else {},
    }


def usage_range(range_name: str, now: datetime | None = None) -> tuple[datetime, datetime, str]:
    """``(start, end, granularity)`` of a dashboard range: ``hour`` (per minute), ``day`` (per hour) or
    ``30d`` (per day), ending after the current bucket. Raises ``ValueError`` for another name."""
    if range_name not in RANGES:
        raise ValueError(f"range must be one of {sorted(RANGES)}")
    span, gran = RANGES[range_name]
    now = now or timezone.now()
    end = bucket_floor(now, gran) + GRANULARITY_STEP[gran]
    return end - span, end, gran



KEY_PAGE_SIZE = 50
_KEY_SUMS = ("requests", "prompt_tokens", "completion_tokens", "status_429", "status_503", "errors")


def _key_search(q: str | None, tenant_id: int | None):
    """``ApiKey`` rows matching ``q`` (in the key's name or tenant's name, or a prefix the key's starts with;
    case-insensitive) and ``tenant_id``; None when there is nothing to filter (every key)."""
    if not q and tenant_id is None:
        return None
    qs = ApiKey.objects.all()
    if tenant_id is not None:
        qs = qs.filter(tenant_id=tenant_id)
    if q:
        qs = qs.filter(Q(name__icontains=q) | Q(prefix__istartswith=q) | Q(tenant__name__icontains=q))
    return qs


def usage_key_table(*, granularity: str, start: datetime, end: datetime, served_model_name: str | None = None,
                    tenant_id: int | None = None, q: str | None = None, page: int = 1,
                    page_size: int = KEY_PAGE_SIZE) -> dict[str, Any]:
    """One page of every API key (revoked ones too) with its usage in ``[start, end)``, most requests first
    (then by id): ``{"count": keys matching, "page", "pages", "page_size", "q", "results": [{"id", "prefix",
    "name", "tenant", "tenant_id", "revoked", "requests", "prompt_tokens", "completion_tokens", "status_429",
    "status_503", "errors", "ttft_p50_ms", "e2e_p50_ms"}]}``.

    ``q`` searches key name, tenant name (substring) and key prefix (start); ``tenant_id`` keeps one tenant's
    keys; ``served_model_name`` counts one model's traffic only. A page past the last answers the last page.
    One SQL statement sorts every matching key by its summed ``UsageRollup`` rows (``rollup_time_idx``), a
    second reads the page's keys, a third their latency histograms; nothing is read per key in Python.
    """
    rollups = UsageRollup.objects.filter(granularity=granularity, bucket_start__gte=start, bucket_start__lt=end)
    if served_model_name:
        rollups = rollups.filter(served_model_name=served_model_name)
    if tenant_id is not None:
        rollups = rollups.filter(tenant_id=tenant_id)
    agg_sql, agg_params = (rollups.order_by().values("api_key_id")
                           .annotate(**{f"s_{f}": Sum(f) for f in _KEY_SUMS}).query.sql_with_params())
    keys = _key_search(q, tenant_id)
    count = keys.count() if keys is not None else ApiKey.objects.count()
    pages = max(1, -(-count // page_size))
    page = min(max(1, page), pages)
    qn = connection.ops.quote_name
    table = qn(ApiKey._meta.db_table)
    where, where_params = "", ()
    if keys is not None:
        keys_sql, where_params = keys.order_by().values("id").query.sql_with_params()
        where = f"WHERE k.{qn('id')} IN ({keys_sql})"
    sums = ", ".join(f"a.{qn('s_' + f)}" for f in _KEY_SUMS)
    sql = (f"SELECT k.{qn('id')}, {sums} FROM {table} k LEFT JOIN ({agg_sql}) a ON a.{qn('api_key_id')} = "
           f"k.{qn('id')} {where} ORDER BY COALESCE(a.{qn('s_requests')}, 0) DESC, k.{qn('id')} LIMIT %s OFFSET %s")
    with connection.cursor() as cur:
        cur.execute(sql, (*agg_params, *where_params, page_size, (page - 1) * page_size))
        ranked = cur.fetchall()
    ids = [r[0] for r in ranked]
    by_id = {k.pk: k for k in ApiKey.objects.filter(pk__in=ids).select_related("tenant")}
    hists: dict[int, dict[str, list[int]]] = defaultdict(lambda: {"ttft": [], "e2e": []})
    active = [r[0] for r in ranked if r[1]]
    if active:
        for key_id, ttft, e2e in rollups.filter(api_key_id__in=active).values_list("api_key_id", "ttft_hist",
                                                                                    "e2e_hist"):
            hist_add(hists[key_id]["ttft"], ttft)
            hist_add(hists[key_id]["e2e"], e2e)
    results = []
    for key_id, *sums_row in ranked:
        k = by_id.get(key_id)
        if k is None:  # deleted between the two reads
            continue
        row: dict[str, Any] = {"id": k.pk, "prefix": k.prefix, "name": k.name, "tenant": k.tenant.name,
                               "tenant_id": k.tenant_id, "revoked": k.revoked_at is not None}
        row.update({f: int(v or 0) for f, v in zip(_KEY_SUMS, sums_row)})
        h = hists.get(key_id)
        for name, short in (("ttft_p50_ms", "ttft"), ("e2e_p50_ms", "e2e")):
            value = hist_quantile(h[short], 0.5) if h else None
            row[name] = None if value is None else round(value, 3)
        results.append(row)
    return {"count": count, "page": page, "pages": pages, "page_size": page_size, "q": q or "",
            "results": results}
