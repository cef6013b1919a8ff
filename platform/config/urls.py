"""Django URL map: admin and the REST control API (the OpenAI surface is routed in ``config.asgi``)."""

from django.contrib import admin
from django.urls import path

urlpatterns = [
    path("admin/", admin.site.urls),
]
