"""Tenancy models: ``Tenant`` and its ``ApiKey``s (stored as lookup prefix + peppered hash, never plaintext)."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from .limits import Limits


def _default_scopes() -> list[str]:
    return ["inference"]


BUDGET_PERIOD_CHOICES = [("day", "day (UTC)"), ("week", "week (UTC, from Monday)"), ("month", "month (UTC)")]

# Priority tiers of admission and engine scheduling (inference.api.admission.TIERS: lower = more important).
PRIORITY_TIER_CHOICES = [(0, "high"), (1, "standard"), (2, "low")]
PRIORITY_TIER_DEFAULT = 1
FAIR_SHARE_WEIGHT_MAX = 1000


class LimitFields(models.Model):
    """Limits shared by tenants and keys (blank = unlimited); enforced by ``tenancy.limits`` in Redis."""

    rpm_limit = models.PositiveIntegerField(null=True, blank=True, help_text="requests per minute; blank = unlimited")
    tpm_limit = models.PositiveIntegerField(
        null=True, blank=True, help_text="tokens per minute (prompt + max completion reserved at admission)")
    max_concurrent_requests = models.PositiveIntegerField(null=True, blank=True, help_text="requests in flight")
    token_budget = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="tokens per budget period; blank = no budget")
    budget_period = models.CharField(max_length=8, choices=BUDGET_PERIOD_CHOICES, default="month", blank=True)

    class Meta:
        abstract = True

    def limits(self):
        """These limits as a ``tenancy.limits.Limits`` (the hot path's Django-free form)."""
        return Limits(rpm=self.rpm_limit, tpm=self.tpm_limit, max_concurrent=self.max_concurrent_requests,
                      token_budget=self.token_budget, budget_period=self.budget_period or "month")


class Tenant(LimitFields):
    """A customer of the platform; owns API keys and their usage."""

    name = models.CharField(max_length=128, unique=True)
    is_active = models.BooleanField(default=True, help_text="Inactive tenants' keys are refused.")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="tenants"
    )
    cache_group = models.CharField(
        max_length=64, blank=True, default="",
        help_text="Prompt and image caches are shared only within a cache group. Blank = this tenant "
                  "alone; tenants given the same non-blank group share cached prefixes and image features (and "
                  "can tell, from cached_tokens and latency, what the others recently sent).")
    priority_tier = models.PositiveSmallIntegerField(
        choices=PRIORITY_TIER_CHOICES, default=PRIORITY_TIER_DEFAULT,
        help_text="Admission refuses lower tiers first (each model's admission policy sets how much of its limits "
                  "each tier may fill) and engines run waiting requests by tier, then arrival. Requests cannot "
                  "raise it (their 'priority' only orders them later within the tier).")
    fair_share_weight = models.PositiveIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(FAIR_SHARE_WEIGHT_MAX)],
        help_text="When a model is busy (above its policy's fair-share threshold), the tenants queueing for it "
                  "share its admission limits in proportion to their weights; a tenant over its share is refused "
                  "first.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ApiKey(LimitFields):
    """An API key: ``prefix`` (``sk-`` + 8 chars, unique, shown in lists) + HMAC-SHA256 of the full secret.

    ``allowed_models`` empty = every model; ``scopes`` among ``inference``, ``usage:read``, ``keys:write``
    and the operator-only ``metrics``/``operator``. A rotated key points at its successor (``replaced_by``)
    and keeps working until its ``expires_at`` (the grace period).
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=128)
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    secret_hash = models.CharField(max_length=64, editable=False, help_text="hex HMAC-SHA256(pepper, secret)")
    allowed_models = models.JSONField(default=list, blank=True)
    scopes = models.JSONField(default=_default_scopes, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    replaced_by = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="replaces", editable=False,
        help_text="the key this one was rotated into")
    priority_tier = models.PositiveSmallIntegerField(
        choices=PRIORITY_TIER_CHOICES, null=True, blank=True,
        help_text="Blank = the tenant's tier. A key's tier can only lower its tenant's (the lower of the two "
                  "applies).")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.prefix} ({self.name})"

    @property
    def effective_priority_tier(self) -> int:
        """The tier its requests get: the key's when set, but never better than its tenant's."""
        tenant_tier = self.tenant.priority_tier
        return tenant_tier if self.priority_tier is None else max(tenant_tier, self.priority_tier)
