"""``GET /v1/models`` and ``GET /v1/models/{model}`` (OpenAI list/retrieve models)."""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async  # closes broken DB connections (a PostgreSQL restart)

from gateway.errors import ErrorCode, not_found
from gateway.http import GatewayConsumer
from gateway.pipeline import limits, preamble
from registry.models import ServedModel
from registry.selectors import served_models_enabled
from tenancy.selectors import AuthContext


def _model_card(m: ServedModel) -> dict[str, Any]:
    return {"id": m.served_model_name, "object": "model", "created": int(m.created_at.timestamp()),
            "owned_by": "platform", "root": m.served_model_name, "parent": None,
            "max_model_len": m.max_model_len}


class ModelsConsumer(GatewayConsumer):
    """Lists the enabled models this key may use; ``/v1/models/<id>`` retrieves one. Needs the ``inference`` scope,
    as the other inference routes (403 ``permission_error`` without it)."""

    methods = ("GET",)

    async def handle_request(self, body: bytes) -> None:
        ctx = await preamble.authenticate(self)  # 401 without a valid key, 403 without the 'inference' scope
        async with limits.held(self, ctx):  # one request of the key's RPM and concurrency
            await self._answer(ctx)

    async def _answer(self, ctx: AuthContext) -> None:
        models = await database_sync_to_async(lambda: list(served_models_enabled()), thread_sensitive=False)()
        cards = [_model_card(m) for m in models
                 if not ctx.allowed_models or m.served_model_name in ctx.allowed_models]
        wanted = self.scope["url_route"]["kwargs"].get("model")
        if wanted:
            for card in cards:
                if card["id"] == wanted:
                    await self.send_json(200, card)
                    return
            raise not_found(f"The model '{wanted}' does not exist", "model", ErrorCode.MODEL_NOT_FOUND)
        await self.send_json(200, {"object": "list", "data": cards})
