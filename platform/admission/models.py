"""Admission models: ``AdmissionPolicy``, the per-model queue limits (DESIGN.md §3)."""

from __future__ import annotations

from django.core.validators import MinValueValidator
from django.db import models

from registry.models import ServedModel


class AdmissionPolicy(models.Model):
    """Queue limits of one served model; both empty = unbounded (the default, also when no row exists).

    ``max_num_queued_reqs``: admitted and unfinished requests (``n`` counts n); ``max_num_queued_tokens``:
    prompt tokens of admitted requests still waiting for their first token; ``target_ttft_ms``: the TTFT
    the sizing help aims at (suggested tokens = target TTFT × measured prefill throughput). Saved limits
    are published to Redis (``services.admission_policy_publish``) and in force in every api process at once.
    """

    served_model = models.OneToOneField(ServedModel, on_delete=models.CASCADE, related_name="admission_policy")
    max_num_queued_reqs = models.PositiveIntegerField(
        null=True, blank=True, help_text="Admitted, unfinished requests (n counts n). Empty = unbounded; 0 = refuse all.")
    max_num_queued_tokens = models.PositiveBigIntegerField(
        null=True, blank=True,
        help_text="Prompt tokens of admitted requests without a first token yet. Empty = unbounded.")
    target_ttft_ms = models.PositiveIntegerField(
        default=2000, validators=[MinValueValidator(1)], help_text="Target time to first token for sizing.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "admission policy"
        verbose_name_plural = "admission policies"
        ordering = ["served_model__served_model_name"]

    def __str__(self) -> str:
        return f"admission policy of {self.served_model.served_model_name}"
