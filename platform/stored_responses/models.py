"""Stored responses of the Responses API (``store: true``, the default): the response with its status, usage and
echoed parameters, and its items, each turn's input items and then its output items, in order.

A response belongs to the tenant (and key) that created it; every read and write names the tenant, so another
tenant's id is "not found". ``ancestors`` are the ids of the chain it continues (``previous_response_id``, oldest
first): a follow-up's context is the ancestors' items, then its own. ``expires_at`` comes from the tenant's
``ResponseRetention`` (else ``settings.RESPONSES_RETENTION_DAYS``); beat purges expired responses with their items.
"""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from tenancy.models import ApiKey, Tenant

STATUS_CHOICES = [(s, s) for s in ("queued", "in_progress", "completed", "incomplete", "failed", "cancelled")]
MAX_RETENTION_DAYS = 3650


class ResponseRetention(models.Model):
    """How long a tenant's stored responses are kept (without a row: ``settings.RESPONSES_RETENTION_DAYS``)."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="response_retention")
    retention_days = models.PositiveIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(MAX_RETENTION_DAYS)],
        help_text="Days a stored response (and its items) is kept after it was created; then it is purged.")

    class Meta:
        verbose_name = "response retention"

    def __str__(self) -> str:
        return f"{self.tenant.name}: {self.retention_days} days"


class StoredResponse(models.Model):
    """One stored response (module docstring). ``params``: the request parameters the response object repeats;
    ``request``: a background response's validated body, for the runner (cleared when it ends); ``engine_id``: the
    replica that served it, preferred for its follow-ups; ``prompt_tokens``: its whole prompt's length."""

    response_id = models.CharField(max_length=64, unique=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="stored_responses")
    api_key = models.ForeignKey(ApiKey, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    model = models.CharField(max_length=128)
    status = models.CharField(max_length=16, choices=STATUS_CHOICES)
    background = models.BooleanField(default=False)
    previous_response_id = models.CharField(max_length=64, blank=True, default="")
    ancestors = models.JSONField(default=list, blank=True)
    params = models.JSONField(default=dict)
    metadata = models.JSONField(default=dict, blank=True)
    usage = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    incomplete_details = models.JSONField(null=True, blank=True)
    request = models.JSONField(null=True, blank=True)
    engine_id = models.CharField(max_length=128, blank=True, default="")
    prompt_tokens = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField()
    completed_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["tenant", "-created_at"], name="stored_resp_tenant_created")]

    def __str__(self) -> str:
        return self.response_id


class StoredResponseItem(models.Model):
    """One item of a stored response: ``direction`` ``in`` (its request's input, item references resolved) or
    ``out`` (what the model wrote), ``position`` its index there, ``data`` the item object as the API shows it."""

    response = models.ForeignKey(StoredResponse, on_delete=models.CASCADE, related_name="items")
    direction = models.CharField(max_length=3, choices=[("in", "input"), ("out", "output")])
    position = models.PositiveIntegerField()
    item_id = models.CharField(max_length=128, db_index=True)
    item_type = models.CharField(max_length=32)
    data = models.JSONField()

    class Meta:
        ordering = ["response_id", "direction", "position"]
        constraints = [models.UniqueConstraint(fields=["response", "direction", "position"],
                                               name="stored_resp_item_unique_position")]

    def __str__(self) -> str:
        return f"{self.item_id} ({self.item_type})"
