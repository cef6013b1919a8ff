"""``/api/v1/keys``: a tenant's key lifecycle (scope ``keys:write`` or the tenant owner's session).

=========================================  ==========================================================
``GET    /api/v1/keys``                    list (prefix, name, settings; never a secret)
``POST   /api/v1/keys``                    create; the response's ``key`` is the secret, shown once
``GET    /api/v1/keys/{id}``               one key
``PATCH  /api/v1/keys/{id}``               change name, scopes, allowed models, expiry, limits
``DELETE /api/v1/keys/{id}``               revoke (also ``POST /api/v1/keys/{id}/revoke``); 200 with the key
                                          (``status: revoked``), again 200 when repeated
``POST   /api/v1/keys/{id}/rotate``        new secret; the old one works ``grace_period_s`` more seconds
=========================================  ==========================================================

A revoked key is not deleted: it stays in the list (``status: revoked``) and in the audit log, but reading, changing
or rotating it answers 410 ``key_revoked`` (D-178). Every change is in force in every api process at once (``tenancy.invalidation`` announces it on Redis Pub/Sub and
``gateway.auth`` drops its cached lookup; at most 1 s if the announcement is lost) and is recorded in the audit log
(``GET /api/v1/audit``, ``audit``).
The rules on who may change which key live in ``tenancy.services`` (``KeyActor``): a key never creates, changes
or rotates a key wider than itself, never changes or rotates itself, never touches operator-scoped keys.
"""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from rest_framework import exceptions
from rest_framework.response import Response

from tenancy.models import ApiKey
from tenancy.services import (
    KeyActor,
    KeyRuleError,
    api_key_create,
    api_key_revoke,
    api_key_rotate,
    api_key_update,
)

from .base import KeyGone, KeyRuleDenied, TenantAPIView, api_doc, created
from .serializers import ApiKeyCreatedSerializer, ApiKeySerializer, ApiKeyWriteSerializer, RotateSerializer


def _created_payload(api_key: ApiKey, plaintext: str) -> dict:
    data = dict(ApiKeyCreatedSerializer(api_key).data)
    data["key"] = plaintext
    return data


class KeyAPIView(TenantAPIView):
    """Base of the key views: the caller as a ``KeyActor``; service rule errors answered in the envelope."""

    required_scope = "keys:write"

    def actor(self) -> KeyActor:
        """The tenant-side actor: the acting key as stored now (not the authenticated snapshot), or the owner."""
        principal = self.principal
        key = None
        if principal.key_id is not None:
            key = ApiKey.objects.filter(pk=principal.key_id, tenant=principal.tenant).first()
            if key is None:
                raise exceptions.AuthenticationFailed("Invalid API key.")
        return KeyActor(tenant_id=principal.tenant.pk, key=key)

    def handle_exception(self, exc):
        if isinstance(exc, KeyRuleError):
            exc = KeyRuleDenied(exc)
        elif isinstance(exc, ValueError):
            exc = exceptions.ValidationError({"non_field_errors": [str(exc)]})
        return super().handle_exception(exc)


class KeyListView(KeyAPIView):
    """List or create the tenant's API keys."""

    @api_doc(responses=ApiKeySerializer(many=True), summary="List the tenant's API keys")
    def get(self, request):
        keys = ApiKey.objects.filter(tenant=self.principal.tenant).select_related("tenant").order_by("-created_at")
        return Response(ApiKeySerializer(keys, many=True).data)

    @api_doc(request=ApiKeyWriteSerializer, responses={201: ApiKeyCreatedSerializer}, errors=(400, 415),
             summary="Create an API key (its secret is in the response, once)")
    def post(self, request):
        ser = ApiKeyWriteSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        data = dict(ser.validated_data)
        limits = {k: data.pop(k) for k in list(data) if k not in ("name", "scopes", "allowed_models", "expires_at")}
        api_key, plaintext = api_key_create(tenant=self.principal.tenant, name=data["name"],
                                            scopes=data.get("scopes"), allowed_models=data.get("allowed_models"),
                                            expires_at=data.get("expires_at"), limits=limits, actor=self.actor())
        return created(_created_payload(api_key, plaintext))


class KeyDetailView(KeyAPIView):
    """One of the tenant's keys (another tenant's key id answers 404)."""

    def _key(self, pk: int) -> ApiKey:
        return get_object_or_404(ApiKey.objects.select_related("tenant"), pk=pk, tenant=self.principal.tenant)

    def _live_key(self, pk: int) -> ApiKey:
        """``_key``, or 410 ``KeyGone`` when it is revoked."""
        api_key = self._key(pk)
        if api_key.revoked_at is not None:
            raise KeyGone(api_key.revoked_at)
        return api_key

    @api_doc(responses=ApiKeySerializer, errors=(404, 410), summary="Show one API key (410 once revoked)")
    def get(self, request, pk: int):
        return Response(ApiKeySerializer(self._live_key(pk)).data)

    @api_doc(request=ApiKeyWriteSerializer, responses=ApiKeySerializer, errors=(400, 404, 410, 415),
             summary="Change an API key (410 once revoked)")
    def patch(self, request, pk: int):
        self._key(pk)  # an unknown key: 404 first; then a malformed body: 400 whatever the key's state
        ser = ApiKeyWriteSerializer(data=request.data, partial=True)
        ser.is_valid(raise_exception=True)
        api_key = self._live_key(pk)
        api_key_update(api_key=api_key, actor=self.actor(), **ser.validated_data)
        return Response(ApiKeySerializer(api_key).data)

    @api_doc(request=None, responses=ApiKeySerializer, errors=(404,),
             summary="Revoke an API key: 200 with the key, status 'revoked' (idempotent)",
             description="Revoking, not deleting: the key stays in GET /api/v1/keys with status 'revoked' and in the "
                         "audit log; GET, PATCH and rotate of it answer 410 from then on. A repeated revoke answers "
                         "200 with the same revoked_at.")
    def delete(self, request, pk: int):
        return Response(ApiKeySerializer(api_key_revoke(api_key=self._key(pk), actor=self.actor())).data)


class KeyRevokeView(KeyDetailView):
    """``POST .../revoke``: same as DELETE."""

    http_method_names = ["post", "options"]

    @api_doc(request=None, responses=ApiKeySerializer, errors=(404,),
             summary="Revoke an API key: same as DELETE /api/v1/keys/{id}")
    def post(self, request, pk: int):
        return Response(ApiKeySerializer(api_key_revoke(api_key=self._key(pk), actor=self.actor())).data)


class KeyRotateView(KeyDetailView):
    """``POST .../rotate``: a new secret; the old key expires after ``grace_period_s``."""

    http_method_names = ["post", "options"]

    @api_doc(request=RotateSerializer, responses={201: ApiKeyCreatedSerializer}, errors=(400, 404, 409, 410, 415),
             summary="Rotate an API key (optional grace period for the old secret)")
    def post(self, request, pk: int):
        ser = RotateSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        new, plaintext = api_key_rotate(api_key=self._live_key(pk), grace_s=ser.validated_data["grace_period_s"],
                                        actor=self.actor())
        return created(_created_payload(new, plaintext))
