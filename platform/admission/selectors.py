"""Admission reads: live queue state, refusals and prefill throughput come from Redis, not the database."""

from __future__ import annotations

import redis
from django.conf import settings

from inference.api import admission as adm
from tenancy.models import Tenant

from .redis import redis_client as _redis


def model_admission_state(*, served_model_name: str) -> dict:
    """Live state of a model (see ``inference.api.admission.model_snapshot``)."""
    return adm.model_snapshot(_redis(), settings.LINK_PREFIX, served_model_name)


def model_prefill_throughput(*, served_model_name: str) -> float:
    """Summed prefill tokens per second of the model's live engine replicas (0.0 when none)."""
    return adm.prefill_throughput(_redis(), settings.LINK_PREFIX, served_model_name)


def tenant_rows(tenants: dict[str, dict[str, int]]) -> list[dict]:
    """Per-tenant admission figures of a snapshot (``model_snapshot(...)["tenants"]``) as rows with the tenant's
    name (``tenant`` id string, ``name``, ``queued_reqs``, ``queued_tokens``, ``weight``, ``admitted``,
    ``refused``), busiest first; a tenant id without a row (deleted) is named ``#<id>``."""
    ids = [int(t) for t in tenants if t.isdigit()]
    names = dict(Tenant.objects.filter(pk__in=ids).values_list("pk", "name"))
    rows = [{"tenant": t, "name": names.get(int(t), f"#{t}") if t.isdigit() else t, **v} for t, v in tenants.items()]
    rows.sort(key=lambda r: (-r["queued_tokens"], -r["admitted"] - r["refused"], r["name"]))
    return rows


def admission_tenant_table() -> list[dict]:
    """Live per-tenant admission figures of every model admission knows, for the operator dashboard: one row per
    (model, tenant) with ``model``, ``tier`` (the tenant's tier name), ``fair_share_weight`` (configured) and
    the ``tenant_rows`` figures; models in name order, busiest tenants first. Empty when Redis is unreachable."""
    try:
        r = _redis()
        models = adm.known_models(r, settings.LINK_PREFIX)
        snaps = {m: adm.model_snapshot(r, settings.LINK_PREFIX, m) for m in models}
    except redis.RedisError:
        return []
    ids = {int(t) for s in snaps.values() for t in s["tenants"] if t.isdigit()}
    config = {t.pk: t for t in Tenant.objects.filter(pk__in=ids).only("pk", "priority_tier", "fair_share_weight")}
    rows = []
    for model, snap in snaps.items():
        for row in tenant_rows(snap["tenants"]):
            tenant = config.get(int(row["tenant"])) if row["tenant"].isdigit() else None
            rows.append({"model": model, **row,
                         "tier": adm.TIER_NAMES.get(tenant.priority_tier, "?") if tenant else "-",
                         "fair_share_weight": tenant.fair_share_weight if tenant else "-"})
    return rows
