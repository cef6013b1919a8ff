"""``POST /tokenize`` and ``POST /detokenize`` (reference/vllm_frontend.md §10.1-10.2, issue 4).

Both need an API key with the ``inference`` scope (vLLM leaves them open, conformance C32).

``/tokenize`` takes a completion-style body (``prompt``; ``add_special_tokens`` default true) or a
chat-style body (``messages`` plus the chat route's template arguments: ``add_generation_prompt``,
``continue_final_message``, ``add_special_tokens`` (default false), ``tools``, ``tool_choice``,
``documents``, ``chat_template`` (refused unless the registry allows it), ``chat_template_kwargs``). A chat
body is rendered by exactly the payload the chat route renders (``gateway.chat.render_payload``), so
``/tokenize`` counts what ``/v1/chat/completions`` would send to the engine. Response
``{"count", "max_model_len", "tokens", "token_strs"}``; ``token_strs`` (the tokenizer's token strings) only
when ``return_token_strs`` is true, else null. No length limit beyond the body cap and the renderer's
budgets (a count is what a client asks /tokenize for).

``/detokenize`` ``{"model", "tokens": [int], "skip_special_tokens"?: false}`` → ``{"prompt": str}``; an id
outside ``[0, len(tokenizer))`` → 400 naming it (param ``tokens``).

Rendering runs where ``RENDER_ROUTE`` says (``gateway.render``). Image parts in a chat body are fetched
and processed like the chat route's, and the ids returned are the expanded ones the engine would get.
"""

from __future__ import annotations

import asyncio

from gateway import auth
from gateway.errors import bad_request
from gateway.generation import (
    cache_salt_for,
    call_render,
    client_request_id,
    key_limits_held,
    load_tokenizer,
    resolve_model,
    validated_body,
)
from gateway.http import GatewayConsumer
from gateway.media import render_chat_media
from inference.protocol.openai import (
    DetokenizeRequest,
    RequestValidationError,
    TokenizeChatRequest,
    tokenize_request_class,
    validate_request,
)


async def tokenize_ids(model: dict, req, cache_salt: str, tenant_id: int | None = None) -> list[int]:
    """Token ids of a validated ``/tokenize`` request on ``model`` (chat: rendered template, generation
    prompt included when asked; completion: the prompt, BOS added per ``add_special_tokens``). ``cache_salt``
    (``generation.cache_salt_for``) keys the image features a chat request's images are stored under;
    ``tenant_id``: whose image work it is (``gateway.media.render_chat_media``)."""
    if isinstance(req, TokenizeChatRequest):
        from gateway.chat import render_payload

        # images are fetched, processed (queue mm) and their placeholders expanded, as the chat route does
        result = await render_chat_media(model, render_payload(model, req), cache_salt=cache_salt,
                                         tenant_id=tenant_id)
    else:
        result = await call_render("inference.tokenize_prompt", {
            "tokenizer_dir": model["tokenizer_dir"], "prompt": req.prompt,
            "add_special_tokens": req.add_special_tokens is not False})
    return result["prompt_token_ids"]


class _KeyedConsumer(GatewayConsumer):
    async def _validated(self, body: bytes, schema=None):
        ctx = await auth.authenticate(self.scope["headers"])
        auth.require_scope(ctx, "inference")
        self.extra_headers.append((b"x-request-id", client_request_id(self.header(b"x-request-id"), None).encode()))
        try:
            req = await validated_body(body, lambda data: validate_request(schema or tokenize_request_class(data),
                                                                            data))
        except RequestValidationError as exc:
            raise bad_request(exc.message, exc.param) from None
        model = await resolve_model(ctx, req.model)
        self.cache_salt = cache_salt_for(ctx, getattr(req, "cache_salt", None))
        return ctx, req, model


class TokenizeConsumer(_KeyedConsumer):
    """``POST /tokenize``."""

    async def handle_request(self, body: bytes) -> None:
        ctx, req, model = await self._validated(body)
        async with key_limits_held(self, ctx):  # RPM and concurrency before any work; nothing is generated
            tokens = await tokenize_ids(model, req, self.cache_salt, ctx.tenant_id)
            token_strs = None
            if req.return_token_strs:
                tok = await load_tokenizer(model)
                token_strs = await asyncio.to_thread(lambda: [tok.id_to_token(t) for t in tokens])
            await self.send_json(200, {"count": len(tokens), "max_model_len": model["max_model_len"],
                                       "tokens": tokens, "token_strs": token_strs})


class DetokenizeConsumer(_KeyedConsumer):
    """``POST /detokenize``."""

    async def handle_request(self, body: bytes) -> None:
        ctx, req, model = await self._validated(body, DetokenizeRequest)
        async with key_limits_held(self, ctx):  # RPM and concurrency before any work; nothing is generated
            result = await call_render("inference.detokenize", {
                "tokenizer_dir": model["tokenizer_dir"], "tokens": req.tokens,
                "skip_special_tokens": bool(req.skip_special_tokens)})
            await self.send_json(200, {"prompt": result["prompt"]})
