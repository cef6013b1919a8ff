"""URLconf for the control-plane tests: the admin only (independent of the gateway's config.urls)."""

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
