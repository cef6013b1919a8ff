"""Usage reads for the REST API and the dashboards, from ``UsageRollup``/``UsageTotal`` rows only (never the raw
records).

``usage_series`` returns one point per bucket of the chosen granularity (empty buckets included, so charts
have a continuous time axis) plus totals over the range. Figures per point: requests, prompt/completion/
cached tokens, 429 and 503 counts, errors, aborted, error rate, TTFT p50/p95 and mean, e2e p50/p95/mean.
All tenants and keys together (the operator's charts) come from ``UsageTotal`` (one row per bucket and model).
``usage_key_table`` is the operator's key table: every key, top traffic first, searched and paginated in SQL,
ranked from the per-key range totals (``usage.key_ranges``) when they are fresh.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any, Iterable

from django.db import connection
from django.db.models import Q, Sum

from tenancy.models import ApiKey, Tenant

from .buckets import GRANULARITY_STEP, RANGES, bucket_floor, usage_range
from .histogram import hist_add, hist_quantile
from .key_ranges import KEY_RANGE_SUMS, key_range_window_fresh
from .models import GRANULARITIES, UsageKeyRange, UsageRollup, UsageTotal

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


KEY_PAGE_SIZE = 50
_KEY_SUMS = KEY_RANGE_SUMS
__all__ = ["KEY_PAGE_SIZE", "MAX_POINTS", "RANGES", "usage_key_table", "usage_range", "usage_rollup_rows",
           "usage_series"]


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


def _key_search_ids_sql(q: str, tenant_id: int | None) -> tuple[str, tuple]:
    """SQL of the ids of the keys ``_key_search`` finds, as a ``UNION`` of three selects (key name, key prefix,
    tenant name), so each can use its own index (PostgreSQL: ``pg_trgm`` GIN indexes on ``UPPER(name)`` and
    ``UPPER(prefix)``, the ``tenant_id`` index) rather than one filter over every key."""
    base = ApiKey.objects.order_by()
    if tenant_id is not None:
        base = base.filter(tenant_id=tenant_id)
    parts = [base.filter(name__icontains=q), base.filter(prefix__istartswith=q),
             base.filter(tenant__in=Tenant.objects.order_by().filter(name__icontains=q).values("id"))]
    return parts[0].values("id").union(*(p.values("id") for p in parts[1:])).query.sql_with_params()


def _ranked_live(rollups, keys, page: int, page_size: int) -> list[tuple]:
    """``[(key id, *_KEY_SUMS)]`` of one page, every key (or ``keys``) LEFT JOINed to its summed ``rollups``."""
    agg_sql, agg_params = (rollups.order_by().values("api_key_id")
                           .annotate(**{f"s_{f}": Sum(f) for f in _KEY_SUMS}).query.sql_with_params())
    qn = connection.ops.quote_name
    where, where_params = "", ()
    if keys is not None:
        keys_sql, where_params = keys.order_by().values("id").query.sql_with_params()
        where = f"WHERE k.{qn('id')} IN ({keys_sql})"
    sums = ", ".join(f"a.{qn('s_' + f)}" for f in _KEY_SUMS)
    sql = (f"SELECT k.{qn('id')}, {sums} FROM {qn(ApiKey._meta.db_table)} k LEFT JOIN ({agg_sql}) a "
           f"ON a.{qn('api_key_id')} = k.{qn('id')} {where} "
           f"ORDER BY COALESCE(a.{qn('s_requests')}, 0) DESC, k.{qn('id')} LIMIT %s OFFSET %s")
    with connection.cursor() as cur:
        cur.execute(sql, (*agg_params, *where_params, page_size, (page - 1) * page_size))
        return cur.fetchall()


def _ranked_totals(range_name: str, tenant_id: int | None, q: str | None, page: int,
                   page_size: int) -> list[tuple]:
    """``[(key id, *_KEY_SUMS)]`` of one page from ``UsageKeyRange`` rows (``usage.key_ranges``).

    No search: the keys with traffic in index order (``keyrange_rank_idx`` / ``keyrange_tenant_rank_idx``:
    ``requests DESC, api_key_id``), then, once those run out, the keys without a row by id (their count is read
    only then). Search: the matching keys (``_key_search_ids_sql``) LEFT JOINed to their rows, sorted.
    """
    qn = connection.ops.quote_name
    keys_t, kr_t = qn(ApiKey._meta.db_table), qn(UsageKeyRange._meta.db_table)
    id_, rng, kid, req = qn("id"), qn("range_name"), qn("api_key_id"), qn("requests")
    sums = ", ".join(f"r.{qn(f)}" for f in _KEY_SUMS)
    offset = (page - 1) * page_size
    with connection.cursor() as cur:
        if q:
            ids_sql, ids_params = _key_search_ids_sql(q, tenant_id)
            cur.execute(f"SELECT k.{id_}, {sums} FROM {keys_t} k LEFT JOIN {kr_t} r ON r.{rng} = %s AND "
                        f"r.{kid} = k.{id_} WHERE k.{id_} IN ({ids_sql}) "
                        f"ORDER BY COALESCE(r.{req}, 0) DESC, k.{id_} LIMIT %s OFFSET %s",
                        (range_name, *ids_params, page_size, offset))
            return cur.fetchall()
        tenant_sql, tenant_params = ("", ()) if tenant_id is None else (f" AND r.{qn('tenant_id')} = %s", (tenant_id,))
        active_from = (f"FROM {kr_t} r JOIN {keys_t} k ON k.{id_} = r.{kid} WHERE r.{rng} = %s{tenant_sql}")
        cur.execute(f"SELECT r.{kid}, {sums} {active_from} ORDER BY r.{req} DESC, r.{kid} LIMIT %s OFFSET %s",
                    (range_name, *tenant_params, page_size, offset))
        ranked = cur.fetchall()
        if len(ranked) == page_size:
            return ranked
        cur.execute(f"SELECT COUNT(*) {active_from}", (range_name, *tenant_params))
        active = cur.fetchone()[0]
        idle_tenant = "" if tenant_id is None else f"k.{qn('tenant_id')} = %s AND "
        cur.execute(f"SELECT k.{id_} FROM {keys_t} k WHERE {idle_tenant}NOT EXISTS (SELECT 1 FROM {kr_t} r "
                    f"WHERE r.{rng} = %s AND r.{kid} = k.{id_}) ORDER BY k.{id_} LIMIT %s OFFSET %s",
                    (*tenant_params, range_name, page_size - len(ranked), max(0, offset - active)))
        return ranked + [(row[0], *(0 for _ in _KEY_SUMS)) for row in cur.fetchall()]


def usage_key_table(*, granularity: str, start: datetime, end: datetime, served_model_name: str | None = None,
                    tenant_id: int | None = None, q: str | None = None, page: int = 1,
                    page_size: int = KEY_PAGE_SIZE, range_name: str | None = None) -> dict[str, Any]:
    """One page of every API key (revoked ones too) with its usage in ``[start, end)``, most requests first
    (then by id): ``{"count": keys matching, "page", "pages", "page_size", "q", "source": "totals" | "live",
    "results": [{"id", "prefix", "name", "tenant", "tenant_id", "revoked", "requests", "prompt_tokens",
    "completion_tokens", "status_429", "status_503", "errors", "ttft_p50_ms", "e2e_p50_ms"}]}``.

    ``q`` searches key name, tenant name (substring) and key prefix (start); ``tenant_id`` keeps one tenant's
    keys; ``served_model_name`` counts one model's traffic only. A page past the last answers the last page.

    Source of the ranking and figures: with ``range_name`` (the dashboard range ``[start, end)`` is) and no model
    filter, and that range's totals fresh (``usage.key_ranges.key_range_window_fresh``), the ``UsageKeyRange``
    rows (``"totals"``: an index range scan per page; see D-155 for the staleness bound). Otherwise
    (``"live"``) one statement sums every matching key's ``UsageRollup`` rows in the range and sorts. Either
    way latency p50s are merged from the page's keys' rollups only.
    """
    rollups = UsageRollup.objects.filter(granularity=granularity, bucket_start__gte=start, bucket_start__lt=end)
    if served_model_name:
        rollups = rollups.filter(served_model_name=served_model_name)
    if tenant_id is not None:
        rollups = rollups.filter(tenant_id=tenant_id)
    keys = _key_search(q, tenant_id)
    count = keys.count() if keys is not None else ApiKey.objects.count()
    pages = max(1, -(-count // page_size))
    page = min(max(1, page), pages)
    use_totals = bool(range_name and not served_model_name and key_range_window_fresh(range_name, start))
    if use_totals:
        ranked = _ranked_totals(str(range_name), tenant_id, q, page, page_size)
    else:
        ranked = _ranked_live(rollups, keys, page, page_size)
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
            "source": "totals" if use_totals else "live", "results": results}
