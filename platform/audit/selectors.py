"""Audit log reads: the entries about one tenant's API keys (the tenant's view; operators use the admin)."""

from __future__ import annotations

from auditlog.models import LogEntry
from django.contrib.contenttypes.models import ContentType
from django.db.models import QuerySet

from tenancy.models import ApiKey


def api_key_audit_entries(*, tenant_id: int, api_key_id: int | None = None) -> QuerySet:
    """``LogEntry`` rows about the API keys of ``tenant_id`` (only the one ``api_key_id`` when given), newest
    first. The tenant filter comes from the keys' own ``tenant_id``, so another tenant's entries never match."""
    keys = ApiKey.objects.filter(tenant_id=tenant_id)
    if api_key_id is not None:
        keys = keys.filter(pk=api_key_id)
    return (LogEntry.objects.filter(content_type=ContentType.objects.get_for_model(ApiKey),
                                    object_id__in=keys.values("pk"))
            .select_related("actor").order_by("-id"))
