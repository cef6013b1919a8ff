"""Dashboard pages and their JSON, the offline API docs page, and static files served by the platform.

- ``/usage/`` tenant page: login required; shows only the keys of the tenant the user owns.
- ``/admin/usage/rollup/`` (the admin's "Usage dashboard"): staff, across all tenants; its JSON at
  ``/admin/usage-data``.
- ``/api/v1/docs`` Swagger UI and ``/api/v1/redoc`` ReDoc, from drf-spectacular-sidecar's files (no CDN).
- ``/static/<path>``: app static files (admin, Chart.js, dashboard JS) and the sidecar's, so the
  platform works offline under plain uvicorn (no separate web server, any ``DEBUG``).
"""

from __future__ import annotations

import json
from pathlib import Path

from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import login_required
from django.contrib.staticfiles import finders
from django.http import Http404, HttpResponseForbidden, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET
from django.views.static import serve

from tenancy.models import ApiKey, Tenant

from .selectors import RANGES, usage_range, usage_series

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


def _owned_tenant(request) -> Tenant | None:
    tenants = Tenant.objects.filter(owner=request.user, is_active=True).order_by("pk")
    wanted = request.GET.get("tenant")
    if wanted and wanted.isdigit():
        tenants = tenants.filter(pk=int(wanted))
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


def _keys_of(tenant_id: int | None):
    qs = ApiKey.objects.select_related("tenant").order_by("tenant__name", "-created_at")
    if tenant_id is not None:
        qs = qs.filter(tenant_id=tenant_id)
    return [{"id": k.pk, "prefix": k.prefix, "name": k.name, "tenant": k.tenant.name,
             "revoked": k.revoked_at is not None} for k in qs]


def _params(request):
    range_name = request.GET.get("range") or "hour"
    if range_name not in RANGES:
        raise Http404("unknown range")
    key = request.GET.get("api_key_id") or ""
    return range_name, int(key) if key.isdigit() else None, request.GET.get("model") or None


@login_required
@require_GET
def tenant_dashboard(request):
    """The tenant page: only the keys of the tenant the logged-in user owns."""
    tenant = _owned_tenant(request)
    if tenant is None:
        return HttpResponseForbidden("This user owns no active tenant.")
    range_name, key_id, model = _params(request)
    keys = _keys_of(tenant.pk)
    if key_id is not None and key_id not in {k["id"] for k in keys}:
        raise Http404("no such key")
    data = dashboard_payload(range_name=range_name, tenant_id=tenant.pk, api_key_id=key_id, model=model)
    return render(request, "usage/dashboard.html", {
        "title": f"Usage — {tenant.name}", "operator": False, "tenant": tenant, "keys": keys,
        "range": range_name, "api_key_id": key_id, "ranges": list(RANGES),
        "initial_json": json.dumps(data), "data_url": f"/usage/data?tenant={tenant.pk}",
        "ws_path": "/ws/usage/", "data": data, "keys_json": json.dumps(keys),
    })


@login_required
@require_GET
def tenant_dashboard_data(request):
    """JSON of the tenant page (same figures as the page)."""
    tenant = _owned_tenant(request)
    if tenant is None:
        return JsonResponse({"error": {"message": "This user owns no active tenant.", "type": "permission_error",
                                       "param": None, "code": None}}, status=403)
    range_name, key_id, model = _params(request)
    if key_id is not None and not ApiKey.objects.filter(pk=key_id, tenant=tenant).exists():
        raise Http404("no such key")
    return JsonResponse(dashboard_payload(range_name=range_name, tenant_id=tenant.pk, api_key_id=key_id,
                                          model=model))


@staff_member_required
@require_GET
def operator_dashboard_data(request):
    """JSON of the operator page: every tenant, optionally one ``tenant`` or ``api_key_id``."""
    range_name, key_id, model = _params(request)
    tenant = request.GET.get("tenant")
    return JsonResponse(dashboard_payload(range_name=range_name, tenant_id=int(tenant) if tenant and tenant.isdigit()
                                          else None, api_key_id=key_id, model=model))


def operator_dashboard_context(request) -> dict:
    """Template context of the operator page (used by the admin's changelist view of ``UsageRollup``)."""
    range_name, key_id, model = _params(request)
    data = dashboard_payload(range_name=range_name, tenant_id=None, api_key_id=key_id, model=model)
    return {
        "title": "Usage dashboard (all tenants)", "operator": True, "keys": _keys_of(None), "range": range_name,
        "api_key_id": key_id, "ranges": list(RANGES), "initial_json": json.dumps(data),
        "data_url": "/admin/usage-data?", "ws_path": "/ws/usage/", "data": data,
        "keys_json": json.dumps(_keys_of(None)),
    }


@login_required
def api_docs(request, kind: str = "swagger"):
    """Swagger UI (``kind="swagger"``) or ReDoc page for ``/api/v1/schema``, with locally served assets."""
    return render(request, f"api/{kind}.html", {"schema_url": "/api/v1/schema"})
