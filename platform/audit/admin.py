"""The audit log in the admin: django-auditlog's read-only ``LogEntry`` admin with who and where it came from.

Nobody adds, edits or deletes entries there (django-auditlog's admin allows none of it).
"""

from __future__ import annotations

from auditlog.admin import LogEntryAdmin
from auditlog.models import LogEntry
from django.contrib import admin

from audit.context import SOURCES


class SourceFilter(admin.SimpleListFilter):
    """Filter by the surface the change came from (one of ``audit.context.SOURCES``)."""

    title = "source"
    parameter_name = "source"

    def lookups(self, request, model_admin):
        return [(s, s) for s in SOURCES]

    def queryset(self, request, queryset):
        value = self.value()
        if value is None:
            return queryset
        if value == "system":
            return queryset.filter(additional_data__source="system") | queryset.filter(additional_data__isnull=True)
        return queryset.filter(additional_data__source=value)


admin.site.unregister(LogEntry)


@admin.register(LogEntry)
class AuditLogEntryAdmin(LogEntryAdmin):
    """Every change to tenants, keys, served models and admission policies: when, what (fields before and
    after), who (user or API key), from where (source, client address)."""

    list_display = ["created", "resource_url", "action", "operation", "msg_short", "who", "source", "remote_addr"]
    list_filter = ["action", SourceFilter, *LogEntryAdmin.list_filter[1:]]
    readonly_fields = [*LogEntryAdmin.readonly_fields, "operation", "who", "source", "remote_addr"]
    fieldsets = [
        (None, {"fields": ["created", "who", "source", "remote_addr", "resource_url", "cid"]}),
        ("Changes", {"fields": ["action", "operation", "msg"]}),
    ]

    @staticmethod
    def _data(obj) -> dict:
        return obj.additional_data if isinstance(obj.additional_data, dict) else {}

    @admin.display(description="operation")
    def operation(self, obj) -> str:
        return str(self._data(obj).get("operation", ""))

    @admin.display(description="source")
    def source(self, obj) -> str:
        data = self._data(obj)
        source = str(data.get("source", "system"))
        return f"{source} ({data['command']})" if data.get("command") else source

    @admin.display(description="who")
    def who(self, obj) -> str:
        key = self._data(obj).get("api_key")
        if isinstance(key, dict):
            return f"API key {key.get('prefix', '')} (id {key.get('id')})"
        if obj.actor is not None:
            return f"user {obj.actor.get_username()}"
        return "-"
