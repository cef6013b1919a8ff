"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's ``/tokenize`` and ``/detokenize``).

Both need an API key with the ``inference`` scope (vLLM leaves them open, conformance C32).

``/tokenize`` takes a completion-style body (``prompt``; ``add_special_tokens`` default true) or a
chat-style body (``messages`` plus the chat route's template arguments: ``add_generation_prompt``,
``continue_final_message``, ``add_special_tokens`` (default false), ``tools``, ``tool_choice``,
``documents``, ``chat_template`` (refused unless the registry allows it), ``chat_template_kwargs``). A chat
body is rendered by exactly the payload the chat route renders (``gateway.pipeline.rendering.chat_render_payload``), so
``/tokenize`` counts what ``/v1/chat/completions`` would send to the engine. Response
``{"count", "max_model_len", "tokens", "token_strs"}``; ``token_strs`` (the tokenizer's token strings) only
when ``return_token_strs`` is true, else null. Text that cannot fit the model's context whatever its
tokenization (more than ``max_model_len × longest token string`` characters, ``rendering.check_prompt_chars``)
is refused with 400 ``context_length_exceeded`` before tokenizing (vLLM would tokenize it; docs/DECISIONS.md).

``/detokenize`` ``{"model", "tokens": [int], "skip_special_tokens"?: false}`` → ``{"prompt": str}``; an id
outside ``[0, len(tokenizer))`` → 400 naming it (param ``tokens``).

Rendering runs where ``RENDER_ROUTE`` says (``gateway.pipeline.rendering``). Image parts in a chat body are fetched
and processed like the chat route's, and the ids returned are the expanded ones the engine would get.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.http import GatewayConsumer
from gateway.model_cache import ModelSnapshot
from gateway.pipeline import inputs, limits, preamble, rendering
from gateway.pipeline.media import render_chat_media
from inference.protocol.openai import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    tokenize_request_class,
    validate_request,
)
from tenancy.selectors import AuthContext


async def tokenize_ids(model: ModelSnapshot, req: TokenizeChatRequest | TokenizeCompletionRequest, cache_salt: str, tenant_id: int | None = None) -> list[int]:
    """Token ids of a validated ``/tokenize`` request on ``model`` (chat: rendered template, generation
    prompt included when asked, images expanded as the chat route does; completion: the prompt, BOS added per
    ``add_special_tokens``). ``cache_salt`` (``inputs.cache_salt_for``) keys the image features and the segment cache;
    ``tenant_id``: whose image work it is."""
    tokenizer = await rendering.load_tokenizer(model)
    if isinstance(req, TokenizeChatRequest):
        rendering.check_prompt_chars(model, tokenizer, rendering.message_chars(req.messages), "messages")
        result = await render_chat_media(model, rendering.chat_render_payload(model, req), cache_salt=cache_salt,
                                         tenant_id=tenant_id)
        return result.prompt_token_ids
    rendering.check_prompt_chars(model, tokenizer, len(req.prompt), "prompt")
    return await rendering.tokenize_prompt(model, req.prompt, req.add_special_tokens is not False, cache_salt)


async def _validated(consumer: GatewayConsumer, ctx: AuthContext, body: bytes,
                     schema: type | None = None) -> tuple[Any, ModelSnapshot]:
    """Echo a request id, validate (``/tokenize``: chat or completion body by its keys), resolve the model.
    Returns ``(req, model)``. Runs under the key's limits (taken right after authentication)."""
    preamble.echo_request_id(consumer, preamble.client_request_id(consumer.header(b"x-request-id"), None))
    req = await preamble.parse(body, lambda data: validate_request(schema or tokenize_request_class(data), data))
    model = await preamble.resolve_model(ctx, req.model)
    return req, model


class TokenizeConsumer(GatewayConsumer):
    """``POST /tokenize``."""

    async def handle_request(self, body: bytes) -> None:
        ctx = await preamble.authenticate(self)
        async with limits.held(self, ctx):  # RPM and concurrency before any work; nothing is generated
            req, model = await _validated(self, ctx, body)
            salt = inputs.cache_salt_for(ctx, getattr(req, "cache_salt", None))
            tokens = await tokenize_ids(model, req, salt, ctx.tenant_id)
            if not req.return_token_strs:  # ints only: orjson writes json.dumps's bytes, ~10x faster
                await self.send_json_fast(200, {"count": len(tokens), "max_model_len": model.max_model_len,
                                                "tokens": tokens, "token_strs": None})
                return
            tok = await rendering.load_tokenizer(model)
            token_strs = await asyncio.to_thread(lambda: [tok.id_to_token(t) for t in tokens])
            await self.send_json(200, {"count": len(tokens), "max_model_len": model.max_model_len,
                                       "tokens": tokens, "token_strs": token_strs})


class DetokenizeConsumer(GatewayConsumer):
    """``POST /detokenize``."""

    async def handle_request(self, body: bytes) -> None:
        ctx = await preamble.authenticate(self)
        async with limits.held(self, ctx):  # RPM and concurrency before any work; nothing is generated
            req, model = await _validated(self, ctx, body, DetokenizeRequest)
            text = await rendering.detokenize(model, req.tokens, bool(req.skip_special_tokens))
            await self.send_json(200, {"prompt": text})
