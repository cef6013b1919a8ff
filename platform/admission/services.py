"""Admission writes: publish limits to Redis (the api processes read them there, never the database)."""

from __future__ import annotations

from django.conf import settings
from django.db import transaction

from inference.api import admission as adm
from registry.models import ServedModel

from .models import AdmissionPolicy
from .redis import redis_client
from .selectors import model_prefill_throughput


POLICY_FIELDS = ("max_num_queued_reqs", "max_num_queued_tokens", "target_ttft_ms", "fair_share_threshold_pct",
                 "high_tier_reserve_pct", "low_tier_ceiling_pct")


def admission_policy_publish(*, policy: AdmissionPolicy) -> None:
    """Publish ``policy``'s limits for its model to Redis (in force at the next admission check)."""
    adm.limits_publish(redis_client(), settings.LINK_PREFIX, policy.served_model.served_model_name,
                       policy.max_num_queued_reqs, policy.max_num_queued_tokens,
                       fair_share_threshold_pct=policy.fair_share_threshold_pct, tier_ceilings=policy.tier_ceilings())


def admission_limits_clear(*, served_model_name: str) -> None:
    """Publish "unbounded" for ``served_model_name`` (its policy was deleted)."""
    adm.limits_publish(redis_client(), settings.LINK_PREFIX, served_model_name, None, None)


def admission_policies_publish_all() -> int:
    """Republish every model's limits (unbounded for models without a policy); returns models published.

    Run by beat every ``ADMISSION_REPUBLISH_S`` so a flushed or replaced Redis recovers by itself.
    """
    policies = {p.served_model_id: p for p in AdmissionPolicy.objects.select_related("served_model")}
    count = 0
    for sm in ServedModel.objects.all():
        p = policies.get(sm.pk)
        if p is not None:
            admission_policy_publish(policy=p)
        else:
            adm.limits_publish(redis_client(), settings.LINK_PREFIX, sm.served_model_name, None, None)
        count += 1
    return count


def admission_policy_update(*, policy: AdmissionPolicy, **fields) -> AdmissionPolicy:
    """Set ``fields`` (``POLICY_FIELDS``) and save; the ``post_save`` hook publishes after commit."""
    for name, value in fields.items():
        if name not in POLICY_FIELDS:
            raise ValueError(f"unknown admission policy field {name!r}")
        setattr(policy, name, value)
    policy.full_clean()
    policy.save()
    return policy


def admission_policy_get_or_create(*, served_model: ServedModel) -> AdmissionPolicy:
    """The model's policy, created unbounded when missing."""
    policy, _ = AdmissionPolicy.objects.get_or_create(served_model=served_model)
    return policy


def suggested_max_num_queued_tokens(*, target_ttft_ms: int, prefill_tokens_per_s: float) -> int | None:
    """``target_TTFT × prefill throughput`` in tokens (``None`` when no throughput was measured)."""
    if prefill_tokens_per_s <= 0:
        return None
    return max(1, int(target_ttft_ms / 1000.0 * prefill_tokens_per_s))


def admission_policy_apply_suggested(*, policy: AdmissionPolicy) -> int | None:
    """Set ``max_num_queued_tokens`` to the suggestion from the live engines; ``None`` (unchanged) when
    no engine has measured prefill throughput yet."""
    tps = model_prefill_throughput(served_model_name=policy.served_model.served_model_name)
    value = suggested_max_num_queued_tokens(target_ttft_ms=policy.target_ttft_ms, prefill_tokens_per_s=tps)
    if value is None:
        return None
    admission_policy_update(policy=policy, max_num_queued_tokens=value)
    return value


def on_policy_saved(sender, instance: AdmissionPolicy, **kwargs) -> None:
    """``post_save`` receiver: publish after the transaction commits (ORM saves and admin edits alike)."""
    transaction.on_commit(lambda: admission_policy_publish(policy=instance))


def on_policy_deleted(sender, instance: AdmissionPolicy, **kwargs) -> None:
    """``post_delete`` receiver: the model becomes unbounded."""
    name = instance.served_model.served_model_name
    transaction.on_commit(lambda: admission_limits_clear(served_model_name=name))
