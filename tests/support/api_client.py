"""DRF test clients for the key-authenticated REST API."""

from __future__ import annotations

from rest_framework.test import APIClient


def bearer_client(secret: str) -> APIClient:
    """An ``APIClient`` that sends ``Authorization: Bearer <secret>`` on every request."""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client
