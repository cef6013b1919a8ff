"""Usage models: one ``UsageRecord`` per request (DESIGN.md §7), written in batches by ``usage_events_flush``."""

from __future__ import annotations

from django.db import models


class UsageRecord(models.Model):
    """What one request used and how it went. ``request_id`` is unique, so re-delivered events are no-ops."""

    request_id = models.CharField(max_length=255, unique=True)
    tenant = models.ForeignKey(
        "tenancy.Tenant", null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_records"
    )
    api_key = models.ForeignKey(
        "tenancy.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_records"
    )
    served_model_name = models.CharField(max_length=128, blank=True, default="")
    endpoint = models.CharField(max_length=64, blank=True, default="")
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    status_code = models.PositiveSmallIntegerField(default=200)
    finish_reason = models.CharField(max_length=16, blank=True, default="")
    ttft_ms = models.FloatField(null=True, blank=True, help_text="first token time - arrival time, ms")
    e2e_latency_ms = models.FloatField(default=0.0, help_text="finish time - arrival time, ms")
    n = models.PositiveSmallIntegerField(default=1)
    created_at = models.DateTimeField(help_text="request arrival")
    finished_at = models.DateTimeField()

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["api_key", "created_at"], name="usage_key_created_idx"),
            models.Index(fields=["tenant", "created_at"], name="usage_tenant_created_idx"),
            models.Index(fields=["served_model_name", "created_at"], name="usage_model_created_idx"),
            models.Index(fields=["created_at"], name="usage_created_idx"),
        ]

    def __str__(self) -> str:
        return self.request_id

    @property
    def total_tokens(self) -> int:
        """``prompt_tokens + completion_tokens``."""
        return self.prompt_tokens + self.completion_tokens
