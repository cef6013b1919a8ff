"""Admission models: ``AdmissionPolicy``, the per-model queue limits (docs/ARCHITECTURE.md §3)."""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from inference.api.admission import tier_ceilings_pct
from registry.models import ServedModel


class AdmissionPolicy(models.Model):
    """Queue limits of one served model; both empty = unbounded (the default, also when no row exists).

    ``max_num_queued_reqs``: admitted and unfinished requests (``n`` counts n); ``max_num_queued_tokens``:
    prompt tokens of admitted requests still waiting for their first token; ``target_ttft_ms``: the TTFT
    the sizing help aims at (suggested tokens = target TTFT × measured prefill throughput). Saved limits
    are published to Redis (``services.admission_policy_publish``) and in force in every api process at once.

    Tiers and fairness (``inference.api.admission``): ``fair_share_threshold_pct`` (percent of a limit above which a
    tenant over its weighted share is refused; 100 = off), ``high_tier_reserve_pct`` (the top of each limit kept
    for the high tier), ``low_tier_ceiling_pct`` (the low tier's ceiling).
    """

    served_model = models.OneToOneField(ServedModel, on_delete=models.CASCADE, related_name="admission_policy")
    max_num_queued_reqs = models.PositiveIntegerField(
        null=True, blank=True, help_text="Admitted, unfinished requests (n counts n). Empty = unbounded; 0 = refuse all.")
    max_num_queued_tokens = models.PositiveBigIntegerField(
        null=True, blank=True,
        help_text="Prompt tokens of admitted requests without a first token yet. Empty = unbounded.")
    target_ttft_ms = models.PositiveIntegerField(
        default=2000, validators=[MinValueValidator(1)], help_text="Target time to first token for sizing.")
    fair_share_threshold_pct = models.PositiveSmallIntegerField(
        default=50, validators=[MinValueValidator(0), MaxValueValidator(100)],
        help_text="Above this percent of a limit, a tenant holding more than its weighted share of the limit is "
                  "refused, so tenants within their share still find room. 100 = first come, first served.")
    high_tier_reserve_pct = models.PositiveSmallIntegerField(
        default=0, validators=[MaxValueValidator(100)],
        help_text="Top percent of each limit only the 'high' priority tier may fill.")
    low_tier_ceiling_pct = models.PositiveSmallIntegerField(
        default=75, validators=[MaxValueValidator(100)],
        help_text="The 'low' priority tier is refused above this percent of each limit.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "admission policy"
        verbose_name_plural = "admission policies"
        ordering = ["served_model__served_model_name"]

    def tier_ceilings(self) -> dict[int, int]:
        """{tier: percent of each limit it may fill} (``inference.api.admission.tier_ceilings_pct``)."""
        return tier_ceilings_pct(self.high_tier_reserve_pct, self.low_tier_ceiling_pct)

    def __str__(self) -> str:
        return f"admission policy of {self.served_model.served_model_name}"
