"""``GET /health`` (public) and the JSON 404 for unknown API routes."""

from __future__ import annotations

from gateway.errors import not_found
from gateway.http import GatewayConsumer


class HealthConsumer(GatewayConsumer):
    """Liveness of this api process: 200 with an empty body, answered without I/O."""

    methods = ("GET", "HEAD")

    async def handle_request(self, body: bytes) -> None:
        await self.send_headers(status=200, headers=[(b"content-type", b"text/plain")])
        await self.send_body(b"")


class NotFoundConsumer(GatewayConsumer):
    """Unknown ``/v1/...`` route: 404 in the OpenAI envelope."""

    methods = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")

    async def handle_request(self, body: bytes) -> None:
        raise not_found(f"Unknown route: {self.scope['method']} {self.scope['path']}", None, "unknown_route")
