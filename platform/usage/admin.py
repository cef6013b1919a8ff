"""Admin for usage: a read-only list of records with filters."""

from __future__ import annotations

from django.contrib import admin

from .models import UsageRecord


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    list_display = (
        "request_id", "created_at", "tenant", "api_key", "served_model_name", "endpoint", "status_code",
        "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "n", "ttft_ms", "e2e_latency_ms",
    )
    list_filter = ("status_code", "endpoint", "finish_reason", "served_model_name", "created_at", "tenant")
    search_fields = ("request_id", "served_model_name", "api_key__prefix", "tenant__name")
    list_select_related = ("tenant", "api_key")
    date_hierarchy = "created_at"
    show_full_result_count = False

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
