"""Admin for stored responses: each tenant's retention (editable), the responses and their items (read-only)."""

from __future__ import annotations

from django.contrib import admin

from .models import ResponseRetention, StoredResponse, StoredResponseItem


@admin.register(ResponseRetention)
class ResponseRetentionAdmin(admin.ModelAdmin):
    list_display = ("tenant", "retention_days")
    search_fields = ("tenant__name",)


class StoredResponseItemInline(admin.TabularInline):
    model = StoredResponseItem
    fields = ("direction", "position", "item_id", "item_type", "data")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(StoredResponse)
class StoredResponseAdmin(admin.ModelAdmin):
    list_display = ("response_id", "tenant", "model", "status", "background", "created_at", "expires_at")
    list_filter = ("status", "background", "model", "tenant")
    search_fields = ("response_id", "previous_response_id", "tenant__name")
    list_select_related = ("tenant",)
    date_hierarchy = "created_at"
    show_full_result_count = False
    inlines = [StoredResponseItemInline]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
