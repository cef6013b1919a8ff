"""Shared pieces of the tenant REST API (``/api/v1/...``): authentication, tenant resolution, scopes,
OpenAI-style error envelope.

Credentials: an API key (``Authorization: Bearer sk-...``) carrying the route's scope, or a Django
session of a user who owns the tenant (``Tenant.owner``; such users hold every tenant scope). A user
owning several tenants picks one with ``?tenant=<id>`` (default: the lowest id).
"""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import exceptions, serializers, status
from rest_framework.authentication import SessionAuthentication
from rest_framework.parsers import JSONParser
from rest_framework.permissions import BasePermission
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView, exception_handler

from audit.context import AuditActor, actor_reset, actor_set
from inference.protocol.errors import ErrorType, error_dict
from tenancy.authentication import ApiKeyAuthentication
from tenancy.selectors import AuthContext
from tenancy.models import Tenant

_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 406: "invalid_request_error", 409: "invalid_request_error",
    410: "not_found_error", 415: "invalid_request_error", 429: "rate_limit_error",
}


def _first_error(detail, path: str = "") -> tuple[str, str]:
    """``(param path, message)`` of the first message in DRF's nested error ``detail``: dicts by field name
    or list index, lists of messages, or (``many=True``) lists of per-item dicts where valid items are
    empty. ``{"scopes": {0: ["..."]}}`` → ``("scopes[0]", "...")``."""
    while True:
        if isinstance(detail, dict) and detail:
            key, detail = next(iter(detail.items()))
            path = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))
        elif isinstance(detail, list) and detail:
            if all(isinstance(d, (dict, list)) for d in detail):
                index = next((i for i, d in enumerate(detail) if d), 0)
                path, detail = f"{path}[{index}]", detail[index]
            else:
                detail = detail[0]
        else:
            return path, str(detail)


def envelope_exception_handler(exc, context):
    """DRF exception handler that answers in the OpenAI error envelope ``{"error": {message, type, param,
    code}}``; validation errors name the first bad field in ``param``."""
    response = exception_handler(exc, context)
    if response is None:
        return None
    data = response.data
    param = None
    if isinstance(exc, exceptions.ValidationError) and isinstance(data, dict) and data:
        param, detail = _first_error(data)
        message = f"{param}: {detail}" if param and param != "non_field_errors" else str(detail)
        if param == "non_field_errors":
            param = None
    elif isinstance(data, dict) and "detail" in data:
        message = str(data["detail"])
        param = getattr(exc, "param", None)
    else:
        message = str(data)
    code = getattr(exc, "default_code", None)
    if isinstance(exc, exceptions.APIException):
        codes = exc.get_codes()
        if isinstance(codes, str):
            code = codes
    response.data = error_dict(message, _ERROR_TYPES.get(response.status_code, ErrorType.API), param, code)
    return response


class KeyRuleDenied(exceptions.APIException):
    """A ``tenancy.services.KeyRuleError`` as a DRF error: its status (400 or 403; 410 for a revoked key, 409 for
    one already rotated: the request is well formed, the key's state refuses it), message, ``param``, ``code``."""

    STATUS_BY_CODE = {"revoked": 410, "already_rotated": 409}

    def __init__(self, error):
        self.status_code = self.STATUS_BY_CODE.get(error.code, error.status)
        self.param = error.param
        super().__init__(detail=str(error), code=error.code or ("permission_denied" if error.status == 403
                                                                else "invalid"))


class TenantPrincipal:
    """Who is calling the tenant API: ``tenant`` plus the scopes the credential holds."""

    def __init__(self, tenant: Tenant, scopes: frozenset[str], key_id: int | None):
        self.tenant = tenant
        self.scopes = scopes
        self.key_id = key_id


TENANT_USER_SCOPES = frozenset({"inference", "usage:read", "keys:write"})


def tenant_principal(request) -> TenantPrincipal:
    """The ``TenantPrincipal`` of an authenticated request; raises 403 when the credential has no tenant."""
    auth = getattr(request, "auth", None)
    if auth is not None and hasattr(auth, "tenant_id") and hasattr(auth, "scopes"):
        tenant = Tenant.objects.filter(pk=auth.tenant_id, is_active=True).first()
        if tenant is None:
            raise exceptions.AuthenticationFailed("Invalid API key.")
        return TenantPrincipal(tenant, frozenset(auth.scopes), auth.key_id)
    user = request.user
    tenants = Tenant.objects.filter(owner=user, is_active=True).order_by("pk")
    wanted = request.query_params.get("tenant")
    if wanted:
        if not (wanted.isascii() and wanted.isdigit()):
            raise exceptions.ValidationError({"tenant": "must be an integer id"})
        tenants = tenants.filter(pk=int(wanted))
    tenant = tenants.first()
    if tenant is None:
        raise exceptions.PermissionDenied("This user owns no (such) active tenant.")
    return TenantPrincipal(tenant, TENANT_USER_SCOPES, None)


class HasTenantScope(BasePermission):
    """Allows the request when its credential resolves to a tenant and holds the view's ``required_scope``."""

    message = "This credential lacks the scope this route needs."

    def has_permission(self, request, view) -> bool:
        if not (request.user and request.user.is_authenticated):
            return False
        principal = tenant_principal(request)
        request.tenant_principal = principal
        scope = getattr(view, "required_scope", None)
        if scope and scope not in principal.scopes:
            self.message = f"This API key does not have the '{scope}' scope."
            return False
        return True


class TenantAPIView(APIView):
    """Base view of the tenant API: API key or session auth, tenant + scope check, error envelope."""

    authentication_classes = [ApiKeyAuthentication, SessionAuthentication]
    permission_classes = [HasTenantScope]
    # JSON only, as the schema says: a form-encoded body carries every value as text, which the strict fields
    # (``tenancy.api.serializers``) refuse; it is answered 415.
    parser_classes = [JSONParser]
    renderer_classes = [JSONRenderer]
    required_scope: str | None = None
    schema = AutoSchema()

    def get_exception_handler(self):
        return envelope_exception_handler

    def initial(self, request, *args, **kwargs):
        """DRF's checks; then, for an API key, name the key as the actor of the audit entries this request writes
        (a session's user is named by ``audit.context.AuditContextMiddleware``)."""
        super().initial(request, *args, **kwargs)
        auth = request.auth
        if isinstance(auth, AuthContext):
            self._audit_token = actor_set(AuditActor(source="rest", api_key_id=auth.key_id,
                                                     api_key_prefix=auth.key_prefix,
                                                     remote_addr=request.META.get("REMOTE_ADDR") or None))

    def finalize_response(self, request, response, *args, **kwargs):
        token = self.__dict__.pop("_audit_token", None)
        if token is not None:
            actor_reset(token)
        return super().finalize_response(request, response, *args, **kwargs)

    def permission_denied(self, request, message=None, code=None):
        if request.authenticators and not request.successful_authenticator:
            raise exceptions.NotAuthenticated("Missing credentials: send 'Authorization: Bearer <API key>'.")
        raise exceptions.PermissionDenied(detail=message, code=code)

    @property
    def principal(self) -> TenantPrincipal:
        return self.request.tenant_principal


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    """The schema's ``bearerAuth``: ``Authorization: Bearer sk-...`` (``tenancy.authentication.ApiKeyAuthentication``)."""

    target_class = "tenancy.authentication.ApiKeyAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "an API key holding the route's scope"}


ERROR_ENVELOPE = inline_serializer("Error", {"error": inline_serializer("ErrorDetail", {
    "message": serializers.CharField(), "type": serializers.CharField(),
    "param": serializers.CharField(allow_null=True), "code": serializers.CharField(allow_null=True)})})

# What each error status means on this API (every one answered in ``ERROR_ENVELOPE``).
ERROR_MEANINGS = {
    400: "invalid request: a field or parameter out of its rule (``param`` names it), or a body that is not JSON",
    401: "no credentials, or an unknown, revoked or expired API key",
    403: "the credential lacks the route's scope, or the key may not do this to that key (tenancy rules)",
    404: "no such key of this tenant (or no such page cursor)",
    405: "method not allowed",
    406: "only application/json is answered",
    409: "the key was already rotated: rotate its successor",
    410: "the key is revoked: it stays listed (``status: revoked``) and in the audit log, and cannot be read, "
         "changed or rotated",
    415: "the body must be application/json",
}


def api_doc(*, errors: tuple[int, ...] = (), **kwargs):
    """``drf_spectacular.utils.extend_schema`` for a view method, built on drf-spectacular's ``AutoSchema``
    whatever ``REST_FRAMEWORK["DEFAULT_SCHEMA_CLASS"]`` says. ``errors``: the error statuses the method can
    answer besides 401, 403, 405 and 406 (which every route can), each documented with ``ERROR_ENVELOPE``."""
    responses = kwargs.pop("responses", None)
    if responses is not None and not isinstance(responses, dict):
        responses = {200: responses}
    responses = dict(responses or {})
    for code in sorted({401, 403, 405, 406, *errors}):
        responses.setdefault(code, OpenApiResponse(ERROR_ENVELOPE, description=ERROR_MEANINGS[code]))
    kwargs["responses"] = responses

    def decorator(method):
        method.kwargs = {"schema": AutoSchema}
        return extend_schema(**kwargs)(method)

    return decorator


class KeyGone(exceptions.APIException):
    """410: the key is revoked (``param`` ``id``, code ``key_revoked``); ``revoked_at`` in the message."""

    status_code = 410
    default_code = "key_revoked"

    def __init__(self, revoked_at):
        self.param = "id"
        super().__init__(detail=f"This API key was revoked at {revoked_at.isoformat()}; it stays listed with "
                                "status 'revoked' in GET /api/v1/keys and in GET /api/v1/audit.")


def created(data) -> Response:
    """201 response helper."""
    return Response(data, status=status.HTTP_201_CREATED)
