"""Admin for usage: a read-only list of records, and the operator usage dashboard (all tenants)."""

from __future__ import annotations

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.template.response import TemplateResponse

from .models import UsageRecord, UsageRollup
from .web import BadParam, bad_param_response, can_view_all_tenants, operator_dashboard_context


class ReadOnlyAdmin(admin.ModelAdmin):
    """An admin page that can neither add, change nor delete: usage is written by the gateway only."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyAdmin):
    list_display = (
        "request_id", "created_at", "tenant", "api_key", "served_model_name", "endpoint", "status_code",
        "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "n", "ttft_ms", "e2e_latency_ms",
    )
    list_filter = ("status_code", "endpoint", "finish_reason", "served_model_name", "created_at", "tenant")
    search_fields = ("request_id", "served_model_name", "api_key__prefix", "tenant__name")
    list_select_related = ("tenant", "api_key")
    date_hierarchy = "created_at"
    show_full_result_count = False


@admin.register(UsageRollup)
class UsageDashboardAdmin(ReadOnlyAdmin):
    """"Usage dashboard" in the admin index: charts over the rollups of every tenant, live over WebSocket."""

    def changelist_view(self, request, extra_context=None):
        if not can_view_all_tenants(request.user):
            raise PermissionDenied
        try:
            dashboard = operator_dashboard_context(request)
        except BadParam as exc:
            return bad_param_response(exc)
        context = {**self.admin_site.each_context(request), **dashboard, "opts": self.model._meta}
        return TemplateResponse(request, "admin/usage/dashboard.html", context)

    def has_view_permission(self, request, obj=None):
        """All-tenant usage: ``usage.view_usagerollup`` (not merely staff); see ``usage.web.can_view_all_tenants``."""
        return can_view_all_tenants(request.user)
