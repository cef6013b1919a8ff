"""Django URL map: admin, the tenant REST API, dashboards, API docs, static files.

The OpenAI surface is routed in ``config.asgi`` (Channels); WebSockets in ``usage.routing``.
"""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView
from rest_framework.permissions import IsAuthenticated

from audit.api.views import KeyAuditView
from tenancy.api.urls import urlpatterns as key_urls
from usage import web
from usage.api.views import UsageView

api_v1 = [
    *key_urls,
    path("usage", UsageView.as_view(), name="api-usage"),
    path("audit", KeyAuditView.as_view(), name="api-audit"),
]

urlpatterns = [
    path("admin/usage-data", admin.site.admin_view(web.operator_dashboard_data), name="admin-usage-data"),
    path("admin/", admin.site.urls),
    path("api/v1/", include(api_v1)),
    path("api/v1/schema", SpectacularAPIView.as_view(urlconf=[path("api/v1/", include(api_v1))],
                                                     permission_classes=[IsAuthenticated]),
         name="api-schema"),
    path("api/v1/docs", web.api_docs, {"kind": "swagger"}, name="api-docs"),
    path("api/v1/redoc", web.api_docs, {"kind": "redoc"}, name="api-redoc"),
    path("accounts/login/", auth_views.LoginView.as_view(template_name="registration/login.html",
                                                         next_page="/usage/"), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(next_page="/accounts/login/"), name="logout"),
    path("usage/", web.tenant_dashboard, name="usage-dashboard"),
    path("usage/data", web.tenant_dashboard_data, name="usage-dashboard-data"),
    re_path(r"^static/(?P<path>.+)$", web.static_serve, name="static"),
]

handler404 = "config.errors.not_found"
handler500 = "config.errors.server_error"
