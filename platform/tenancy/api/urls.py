"""URL patterns of ``/api/v1/keys`` (included by ``config.urls`` under ``api/v1/``)."""

from django.urls import path

from .views import KeyDetailView, KeyListView, KeyRevokeView, KeyRotateView

urlpatterns = [
    path("keys", KeyListView.as_view(), name="api-keys"),
    path("keys/<int:pk>", KeyDetailView.as_view(), name="api-key-detail"),
    path("keys/<int:pk>/revoke", KeyRevokeView.as_view(), name="api-key-revoke"),
    path("keys/<int:pk>/rotate", KeyRotateView.as_view(), name="api-key-rotate"),
]
