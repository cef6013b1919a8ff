"""Dashboard pages and their JSON, the offline API docs page, and static files served by the platform.

- ``/usage/`` tenant page: login required; shows only the keys of the tenant the user owns.
- ``/admin/usage/rollup/`` (the admin's "Usage dashboard"): across all tenants, for active staff users holding
  ``usage.view_usagerollup`` (superusers do; ``can_view_all_tenants``); its JSON at ``/admin/usage-data``.
- ``/api/v1/docs`` Swagger UI and ``/api/v1/redoc`` ReDoc, from drf-spectacular-sidecar's files (no CDN).
- ``/static/<path>``: app static files (admin, Chart.js, dashboard JS) and the sidecar's, so the
  platform works offline under plain uvicorn (no separate web server, any ``DEBUG``).

Query parameters of the dashboards: ``range`` (``hour``/``day``/``30d``), ``api_key_id`` and ``tenant`` (positive
64-bit integers), ``model``; the operator's key table also ``q`` (search, at most 128 characters) and ``page``
(positive integer). Any other value answers 400 in the OpenAI error envelope naming the parameter.
"""

from __future__ import annotations

from functools import wraps
from pathlib import Path

from csp.decorators import csp_update
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import login_required
from django.contrib.staticfiles import finders
from django.core.exceptions import PermissionDenied
from django.http import Http404, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET
from django.views.static import serve

from inference.protocol.errors import ErrorType, error_dict
from admission.selectors import admission_tenant_table
from tenancy.models import ApiKey, Tenant

from .selectors import RANGES, usage_key_table, usage_range, usage_series

try:
    import drf_spectacular_sidecar

    SIDECAR_STATIC = Path(drf_spectacular_sidecar.__file__).resolve().parent / "static"
except ImportError:  # pragma: no cover - the sidecar is a declared dependency
    SIDECAR_STATIC = None


def static_serve(request, path: str):
    """Serve ``path`` from the app static folders (finders) or drf-spectacular-sidecar's folder; 404 else."""
    if ".." in path.split("/") or path.startswith("/") or "\\" in path:
        raise Http404(path)
    found = finders.find(path)
    if found:
        found_path = Path(found)
        return serve(request, found_path.name, document_root=str(found_path.parent))
    if SIDECAR_STATIC is not None and path.startswith("drf_spectacular_sidecar/"):
        return serve(request, path, document_root=str(SIDECAR_STATIC))
    raise Http404(path)


OPERATOR_PERMISSION = "usage.view_usagerollup"


def operator_dashboard_url() -> str:
    """Path of the operator dashboard (the admin's changelist of ``UsageRollup``)."""
    return reverse("admin:usage_usagerollup_changelist")
_ID_MAX = 2**63 - 1  # BigAutoField


class BadParam(ValueError):
    """A dashboard query parameter that is not acceptable; ``param`` names it (answered 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def bad_param_response(exc: BadParam) -> JsonResponse:
    """400 in the OpenAI error envelope for ``exc``."""
    return JsonResponse({"error": {"message": f"{exc.param}: {exc}", "type": "invalid_request_error",
                                   "param": exc.param, "code": "invalid_value"}}, status=400)


def can_view_all_tenants(user) -> bool:
    """Whether ``user`` may see every tenant's usage: active staff holding ``usage.view_usagerollup``
    (an active superuser holds every permission). Pass a user fresh from the database to see changes of
    its flags or permissions (``has_perm`` caches on the instance)."""
    return bool(user is not None and user.is_authenticated and user.is_active and user.is_staff
                and user.has_perm(OPERATOR_PERMISSION))


def id_param(params, name: str) -> int | None:
    """Query parameter ``name`` as a positive database id, or None when absent/empty.

    Raises ``BadParam`` for anything but ASCII digits within 1..2**63-1 (``"²".isdigit()`` is true in
    Python, and a 20-digit id overflows the database's integer).
    """
    raw = params.get(name) or ""
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or not 0 < int(raw) <= _ID_MAX:
        raise BadParam(name, "must be a positive integer id")
    return int(raw)


def text_param(params, name: str, max_length: int = 256) -> str | None:
    """Query parameter ``name`` as text (None when absent/empty); ``BadParam`` when longer than
    ``max_length`` or holding a NUL (PostgreSQL refuses NUL in text)."""
    raw = params.get(name) or None
    if raw is not None and (len(raw) > max_length or "\x00" in raw):
        raise BadParam(name, f"must be at most {max_length} characters without NUL")
    return raw


def _owned_tenant(request) -> Tenant | None:
    tenants = Tenant.objects.filter(owner=request.user, is_active=True).order_by("pk")
    wanted = id_param(request.GET, "tenant")
    if wanted is not None:
        tenants = tenants.filter(pk=wanted)
    return tenants.first()


def dashboard_payload(*, range_name: str, tenant_id: int | None, api_key_id: int | None,
                      model: str | None = None) -> dict:
    """What the dashboards draw: ``usage_series`` for the range plus per-key totals (``groups``)."""
    start, end, gran = usage_range(range_name)
    data = usage_series(granularity=gran, start=start, end=end, tenant_id=tenant_id,
                        api_key_ids=[api_key_id] if api_key_id else None, served_model_name=model or None,
                        group_by="key")
    data["range"] = range_name
    return data


def operator_payload(*, range_name: str, tenant_id: int | None, api_key_id: int | None, model: str | None = None,
                     q: str | None = None, page: int = 1) -> dict:
    """What the operator dashboard draws: ``usage_series`` over every tenant (or ``tenant_id``, or one key)
    for the range, and under ``keys`` one page of the key table (``usage_key_table``: every key, top traffic
    first, ``q`` searched, ``page`` of ``KEY_PAGE_SIZE``). ``groups`` is empty: the table replaces it."""
    start, end, gran = usage_range(range_name)
    data = usage_series(granularity=gran, start=start, end=end, tenant_id=tenant_id,
                        api_key_ids=[api_key_id] if api_key_id else None, served_model_name=model or None)
    data["range"] = range_name
    data["keys"] = usage_key_table(granularity=gran, start=start, end=end, served_model_name=model or None,
                                   tenant_id=tenant_id, q=q, page=page, range_name=range_name)
    return data


def _table_params(request) -> tuple[str | None, int]:
    """``(q, page)`` of the operator's key table; ``BadParam`` on bad values."""
    return text_param(request.GET, "q", max_length=128), id_param(request.GET, "page") or 1


def _keys_of(tenant_id: int | None, key_id: int | None = None):
    """Keys of ``tenant_id`` (None: any tenant), or only ``key_id``, for a key menu."""
    qs = ApiKey.objects.select_related("tenant").order_by("tenant__name", "-created_at")
    if tenant_id is not None:
        qs = qs.filter(tenant_id=tenant_id)
    if key_id is not None:
        qs = qs.filter(pk=key_id)
    return [{"id": k.pk, "prefix": k.prefix, "name": k.name, "tenant": k.tenant.name,
             "revoked": k.revoked_at is not None} for k in qs]


def _params(request):
    """``(range, api_key_id, model)`` of the dashboard query; ``BadParam`` on bad values."""
    range_name = request.GET.get("range") or "hour"
    if range_name not in RANGES:
        raise BadParam("range", f"must be one of {sorted(RANGES)}")
    return range_name, id_param(request.GET, "api_key_id"), text_param(request.GET, "model")


def _answers_bad_params(view):
    """Decorator: a ``BadParam`` raised by ``view`` answers 400 in the error envelope."""
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        try:
            return view(request, *args, **kwargs)
        except BadParam as exc:
            return bad_param_response(exc)

    return wrapped


@login_required
@require_GET
@_answers_bad_params
def tenant_dashboard(request):
    """The tenant page: only the keys of the tenant the logged-in user owns.

    A user who owns no active tenant: an operator (``can_view_all_tenants``) is redirected (302) to the
    operator dashboard with the same query string; anyone else gets a styled 403 page saying so."""
    tenant = _owned_tenant(request)
    if tenant is None:
        if can_view_all_tenants(request.user):
            query = request.GET.urlencode()
            return redirect(operator_dashboard_url() + (f"?{query}" if query else ""))
        return render(request, "usage/no_tenant.html", {"title": "No tenant"}, status=403)
    range_name, key_id, model = _params(request)
    keys = _keys_of(tenant.pk)
    if key_id is not None and key_id not in {k["id"] for k in keys}:
        raise Http404("no such key")
    data = dashboard_payload(range_name=range_name, tenant_id=tenant.pk, api_key_id=key_id, model=model)
    return render(request, "usage/dashboard.html", {
        "title": f"Usage — {tenant.name}", "operator": False, "tenant": tenant, "keys": keys,
        "range": range_name, "api_key_id": key_id, "ranges": list(RANGES),
        "data_url": f"/usage/data?tenant={tenant.pk}", "ws_path": "/ws/usage/", "data": data,
    })


@login_required
@require_GET
@_answers_bad_params
def tenant_dashboard_data(request):
    """JSON of the tenant page (same figures as the page)."""
    tenant = _owned_tenant(request)
    if tenant is None:
        return JsonResponse({"error": {"message": "This user owns no active tenant.", "type": "permission_error",
                                       "param": None, "code": None}}, status=403)
    range_name, key_id, model = _params(request)
    if key_id is not None and not ApiKey.objects.filter(pk=key_id, tenant=tenant).exists():
        return JsonResponse(error_dict(f"API key {key_id} is not one of this tenant's keys.", ErrorType.NOT_FOUND,
                                       "api_key_id", None), status=404)
    return JsonResponse(dashboard_payload(range_name=range_name, tenant_id=tenant.pk, api_key_id=key_id,
                                          model=model))


@staff_member_required
@require_GET
@_answers_bad_params
def operator_dashboard_data(request):
    """JSON of the operator page: every tenant, optionally one ``tenant`` or ``api_key_id``.

    403 (error envelope) unless ``can_view_all_tenants(request.user)``."""
    if not can_view_all_tenants(request.user):
        return JsonResponse({"error": {"message": f"The all-tenant usage needs the '{OPERATOR_PERMISSION}' "
                                                  "permission.", "type": "permission_error", "param": None,
                                       "code": None}}, status=403)
    range_name, key_id, model = _params(request)
    tenant_id = id_param(request.GET, "tenant")
    q, page = _table_params(request)
    return JsonResponse(operator_payload(range_name=range_name, tenant_id=tenant_id, api_key_id=key_id,
                                         model=model, q=q, page=page))


def operator_dashboard_context(request) -> dict:
    """Template context of the operator page (used by the admin's changelist view of ``UsageRollup``).

    Raises ``PermissionDenied`` unless ``can_view_all_tenants(request.user)``, ``BadParam`` on bad query
    parameters."""
    if not can_view_all_tenants(request.user):
        raise PermissionDenied(f"needs the '{OPERATOR_PERMISSION}' permission")
    range_name, key_id, model = _params(request)
    tenant_id = id_param(request.GET, "tenant")
    q, page = _table_params(request)
    data = operator_payload(range_name=range_name, tenant_id=tenant_id, api_key_id=key_id, model=model, q=q,
                            page=page)
    # the key menu: the keys of the table's page, and the chosen key wherever it is (never all keys)
    keys = [{f: row[f] for f in ("id", "prefix", "name", "tenant", "revoked")} for row in data["keys"]["results"]]
    if key_id is not None and key_id not in {k["id"] for k in keys}:
        keys = _keys_of(None, key_id) + keys
    data_url = "/admin/usage-data?" + (f"tenant={tenant_id}&" if tenant_id is not None else "")
    return {
        "title": "Usage dashboard (all tenants)", "operator": True, "keys": keys, "range": range_name,
        "api_key_id": key_id, "ranges": list(RANGES), "data_url": data_url, "ws_path": "/ws/usage/",
        "data": data, "q": q or "", "tenant_id": tenant_id,
        "admission_tenants": admission_tenant_table(),
    }


@login_required
def api_docs(request, kind: str = "swagger"):
    """Swagger UI (``kind="swagger"``) or ReDoc page for ``/api/v1/schema``, with locally served assets."""
    return (_redoc_page if kind == "redoc" else _swagger_page)(request)


# The API docs pages' bundles inject <style> elements (ReDoc: styled-components): inline style is allowed
# there only. Scripts stay 'self'.
@csp_update({"style-src": ["'unsafe-inline'"]})
def _swagger_page(request):
    return render(request, "api/swagger.html", {"schema_url": "/api/v1/schema"})


@csp_update({"style-src": ["'unsafe-inline'"], "worker-src": ["blob:"]})
def _redoc_page(request):
    """ReDoc also runs its search index in a worker it makes from a ``blob:`` URL of its own script."""
    return render(request, "api/redoc.html", {"schema_url": "/api/v1/schema"})
