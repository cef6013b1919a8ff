"""``GET /api/v1/audit``: the audit log of the tenant's API keys (scope ``keys:write`` or the owner's session).

Every change to one of the tenant's keys, by the REST API, the admin or a management command: creation, changes
of name, scopes, models, expiry and limits, revocation, rotation. Newest first, cursor-paginated (``cursor``,
``limit`` up to 200, default 50). ``api_key_id`` narrows it to one key (another tenant's or an unknown id: 404).
The tenant comes from the credential, never from a parameter, so a tenant never sees another tenant's entries.
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter
from rest_framework import exceptions, generics
from rest_framework.pagination import CursorPagination

from audit.selectors import api_key_audit_entries
from tenancy.api.base import TenantAPIView, api_doc
from tenancy.models import ApiKey

from .serializers import AuditEntrySerializer


class AuditPagination(CursorPagination):
    """Newest first by entry id (stable while new entries arrive). ``limit`` must be an integer 1-200 (400
    otherwise: DRF would quietly use the default for ``limit=abc``); an unknown ``cursor`` answers 404."""

    ordering = "-id"
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 200

    def get_page_size(self, request):
        raw = request.query_params.get(self.page_size_query_param)
        if raw is None:
            return self.page_size
        if not (raw.isascii() and raw.isdigit() and 1 <= int(raw) <= self.max_page_size):
            raise exceptions.ValidationError({"limit": f"must be an integer from 1 to {self.max_page_size}"})
        return int(raw)

    def decode_cursor(self, request):
        """DRF's cursor, its position held to an entry id (DRF takes any text there, which the id filter would
        then fail on: a 500 for a made-up cursor)."""
        cursor = super().decode_cursor(request)
        if cursor is not None and cursor.position is not None and not (
                str(cursor.position).isascii() and str(cursor.position).isdigit() and int(cursor.position) < 2**63):
            raise exceptions.NotFound(self.invalid_cursor_message)
        return cursor

    def get_schema_operation_parameters(self, view):
        params = super().get_schema_operation_parameters(view)
        for param in params:
            if param["name"] == self.page_size_query_param:
                param["schema"] = {"type": "integer", "minimum": 1, "maximum": self.max_page_size}
        return params


class KeyAuditView(TenantAPIView, generics.ListAPIView):
    """The audit entries of the tenant's keys."""

    required_scope = "keys:write"
    serializer_class = AuditEntrySerializer
    pagination_class = AuditPagination

    def _api_key_id(self) -> int | None:
        raw = self.request.query_params.get("api_key_id")
        if raw is None:
            return None
        if not (raw.isascii() and raw.isdigit() and 0 < int(raw) < 2**63):
            raise exceptions.ValidationError({"api_key_id": "must be a positive integer id"})
        if not ApiKey.objects.filter(pk=int(raw), tenant=self.principal.tenant).exists():
            exc = exceptions.NotFound("No such API key for this tenant.")
            exc.param = "api_key_id"
            raise exc
        return int(raw)

    def get_queryset(self):
        return api_key_audit_entries(tenant_id=self.principal.tenant.pk, api_key_id=self._api_key_id())

    def list(self, request, *args, **kwargs):
        page = self.paginate_queryset(self.get_queryset())
        tenant = self.principal.tenant
        actor_keys = {e.additional_data["api_key"].get("id") for e in page
                      if isinstance(e.additional_data, dict) and isinstance(e.additional_data.get("api_key"), dict)}
        context = {**self.get_serializer_context(), "tenant_owner_id": tenant.owner_id,
                   "tenant_key_ids": set(ApiKey.objects.filter(tenant=tenant, pk__in=[k for k in actor_keys
                                                                                       if isinstance(k, int)])
                                         .values_list("pk", flat=True))}
        return self.get_paginated_response(AuditEntrySerializer(page, many=True, context=context).data)

    @api_doc(summary="Audit log of the tenant's API keys (newest first)", errors=(400, 404),
             responses={200: AuditEntrySerializer(many=True)},
             parameters=[OpenApiParameter("api_key_id", {"type": "integer", "minimum": 1, "maximum": 2**63 - 1},
                                          description="only this key's entries (one of the tenant's key ids)")])
    def get(self, request, *args, **kwargs):
        return self.list(request, *args, **kwargs)
