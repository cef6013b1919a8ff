"""Admission reads: live queue state, refusals and prefill throughput come from Redis, not the database."""

from __future__ import annotations

from django.conf import settings

from inference import admission as adm

from .redis import redis_client as _redis


def model_admission_state(*, served_model_name: str) -> dict:
    """Live state of a model (see ``inference.admission.model_snapshot``)."""
    return adm.model_snapshot(_redis(), settings.LINK_PREFIX, served_model_name)


def model_prefill_throughput(*, served_model_name: str) -> float:
    """Summed prefill tokens per second of the model's live engine replicas (0.0 when none)."""
    return adm.prefill_throughput(_redis(), settings.LINK_PREFIX, served_model_name)
