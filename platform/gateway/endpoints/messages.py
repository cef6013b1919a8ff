"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API, an adapter over the chat
route's steps (``gateway.pipeline.conversation``; docs/ARCHITECTURE.md §2).

The body is validated as Anthropic's (``inference.protocol.anthropic``), turned into the internal chat request
(``inference.api.messages.chat_request``: blocks to messages, tools, tool choice, stop sequences, sampling, thinking)
and run through the same steps as a chat; the parsed output comes back as content blocks or as Anthropic's stream.

* Key: ``x-api-key`` or ``Authorization: Bearer`` (``auth.API_KEY_OR_BEARER``; two different keys: 401).
  ``anthropic-version`` is accepted when it is a date (default ``2023-06-01``; else 400); no field of the usage
  record holds it. ``anthropic-beta`` is ignored.
* Errors: Anthropic's envelope and statuses (``gateway.dialects.ANTHROPIC``), a ``request-id`` header on every
  response, the key limits' headers under Anthropic's names, all before the first byte of a stream; after it, an
  ``event: error``.
* Thinking: a ``thinking`` block's ``signature`` is an HMAC-SHA256 (``inference.api.messages.thinking_signature``)
  under a key derived from Django's ``SECRET_KEY`` with this route's own salt, over the tenant, the served model and
  the text; a replayed block whose signature does not verify is a 400 naming it. ``budget_tokens`` bounds the
  reasoning: a choice still reasoning past that many output tokens is stopped (the engine request aborted) and ends
  with ``stop_reason`` ``max_tokens`` (``ThinkingBudget``; checked per engine output, so the last output's tokens may
  run past it).
* Streaming: ``ping`` every ``PING_INTERVAL_S`` while the prompt prefills, then ``message_start`` (with the real
  input usage: the prefix cache's hit is known at the first token), the blocks' events, ``message_delta`` (stop
  reason, cumulative usage) and ``message_stop``.
* ``count_tokens``: the key's request limits only (nothing generated, nothing admitted), the same conversion and the
  same render as generation (``conversation.prompt_tokens``): ``{"input_tokens"}`` equals a create's
  ``input_tokens + cache_read_input_tokens``.
"""

from __future__ import annotations

import asyncio
import re
from functools import lru_cache
from typing import AsyncIterator, Callable

from django.conf import settings
from django.utils.crypto import salted_hmac

from gateway import auth
from gateway.dialects import ANTHROPIC
from gateway.errors import bad_request
from gateway.http import GatewayConsumer
from gateway.pipeline import conversation, limits, preamble, responses
from gateway.pipeline.failures import api_error_from
from inference.api.chat_output import ChatDelta, ChatOutputParser
from inference.api.messages import (
    Event,
    StreamBlocks,
    ThinkingBudget,
    chat_request,
    message_blocks,
    signature_matches,
    sse,
    stop_reason,
    thinking_signature,
    usage,
)
from inference.api.output_processor import ChoiceDelta
from inference.protocol.anthropic import (
    DEFAULT_VERSION,
    CountTokensRequest,
    MessagesRequest,
    ThinkingEnabled,
    validate_body,
)
from inference.protocol.openai import ChatCompletionRequest, RequestValidationError
from tenancy.selectors import AuthContext

MESSAGES = conversation.Route("messages", "msg_", auth.API_KEY_OR_BEARER)
"""The route's usage name and id prefix; the key from ``x-api-key`` or ``Authorization: Bearer``."""
PING_INTERVAL_S = 10.0
"""Seconds between ``ping`` events while a stream waits for its first token."""
_SIGNATURE_SALT = "llmp.gateway.messages.thinking-signature"
_VERSION = re.compile(r"\d{4}-\d{2}-\d{2}")


@lru_cache(maxsize=4)
def _signing_key(secret: str) -> bytes:
    return bytes(salted_hmac(_SIGNATURE_SALT, "thinking blocks", secret=secret, algorithm="sha256").digest())


def signer(ctx: AuthContext, model: str) -> Callable[[str], str]:
    """The ``signature`` of a thinking block the platform returns to ``ctx``'s tenant from ``model``."""
    key = _signing_key(settings.SECRET_KEY)
    return lambda text: thinking_signature(key, str(ctx.tenant_id), model, text)


def anthropic_version(consumer: GatewayConsumer) -> str:
    """The request's ``anthropic-version`` (``DEFAULT_VERSION`` without the header); 400 when it is not a date."""
    raw = consumer.header(b"anthropic-version")
    if raw is None:
        return DEFAULT_VERSION
    value = raw.decode("latin-1").strip()
    if not _VERSION.fullmatch(value):
        raise bad_request(f"anthropic-version: {value[:64]!r} is not an API version (a date, e.g. "
                          f"'{DEFAULT_VERSION}')", "anthropic-version")
    return value


def internal_request(ctx: AuthContext, req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """``req`` as the internal chat request, its replayed thinking blocks verified for ``ctx``'s tenant and the
    requested model; ``ApiError`` 400 naming the field."""
    key = _signing_key(settings.SECRET_KEY)
    tenant, model = str(ctx.tenant_id), req.model or ""
    try:
        return chat_request(req, lambda text, sig: signature_matches(key, tenant, model, text, sig))
    except RequestValidationError as exc:
        raise api_error_from(exc) from None


class MessagesConsumer(GatewayConsumer):
    """``POST /v1/messages``, streamed or not; every check before the first byte."""

    dialect = ANTHROPIC

    async def handle_request(self, body: bytes) -> None:
        async with conversation.opened(self, body, MESSAGES,
                                       lambda data: validate_body(MessagesRequest, data)) as conv:
            anthropic_version(self)
            req = conv.pre.req
            started = await conversation.start(self, conv, internal_request(conv.pre.ctx, req), size=len(body))
            budget = ThinkingBudget(req.thinking.budget_tokens if isinstance(req.thinking, ThinkingEnabled) else None)
            sign = signer(conv.pre.ctx, started.run.model.served_model_name)
            if req.stream:
                await self._stream(conv, started, budget, sign)
            else:
                await self._complete(conv, started, budget, sign)

    async def _complete(self, conv: conversation.Opened[MessagesRequest], started: conversation.Started,
                        budget: ThinkingBudget, sign: Callable[[str], str]) -> None:
        run, parser = started.run, started.parsers[0]
        if budget.ended:  # no budget to watch: the whole text parsed at once, as the chat route does
            await responses.complete(run)
            parser.push(run.choices[0].text)
            parser.finish()
        else:
            async for d in run.deltas():
                if budget.spent(_parsed(parser, d), len(run.choices[0].token_ids)):
                    conv.scope.recorder.finish_reason = "length"
                    parser.finish()
                    break
            run.raise_for_engine_error(retry_after=True)
        await self.send_json(200, _message(conv.pre.external_id, started, parser, budget, sign))

    async def _stream(self, conv: conversation.Opened[MessagesRequest], started: conversation.Started,
                      budget: ThinkingBudget, sign: Callable[[str], str]) -> None:
        run, parser = started.run, started.parsers[0]
        blocks = StreamBlocks(sign)
        await self.start_sse()
        deltas = run.deltas().__aiter__()
        d = await self._first(deltas)
        head = _message(conv.pre.external_id, started, None, budget, sign)
        await self.send_body(sse(("message_start", {"type": "message_start", "message": head})), more_body=True)
        while d is not None and run.choices[d.index].finish_reason != "error":
            parsed = _parsed(parser, d)
            events = blocks.push(parsed)
            over = not budget.ended and budget.spent(parsed, len(run.choices[0].token_ids))
            if events:
                await self.send_body(b"".join([sse(e) for e in events]), more_body=True)
            if over:
                conv.scope.recorder.finish_reason = "length"
                break
            d = await anext(deltas, None)
        run.raise_for_engine_error(retry_after=False)
        reason, sequence = _stop(started, parser, budget)
        end: list[Event] = [*blocks.finish(), ("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(run.prompt_tokens, run.num_cached_tokens, run.completion_tokens)}),
                            ("message_stop", {"type": "message_stop"})]
        await self.send_body(b"".join(sse(e) for e in end), more_body=False)

    async def _first(self, deltas: AsyncIterator[ChoiceDelta]) -> ChoiceDelta | None:
        """The first delta (``None``: none came), with a ``ping`` every ``PING_INTERVAL_S`` while it is awaited."""
        task = asyncio.ensure_future(anext(deltas, None))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=PING_INTERVAL_S)
                if done:
                    return task.result()
                await self.send_body(sse(("ping", {"type": "ping"})), more_body=True)
        finally:
            if not task.done():
                task.cancel()


def _parsed(parser: ChatOutputParser, d: ChoiceDelta) -> ChatDelta:
    """The parser's output for delta ``d``: its text pushed, and what the parser held back when ``d`` is the last."""
    out = parser.push(d.text) if d.text else ChatDelta()
    if d.finish_reason is not None:
        tail = parser.finish()
        out = ChatDelta(out.reasoning + tail.reasoning, out.content + tail.content, out.calls + tail.calls)
    return out


def _stop(started: conversation.Started, parser: ChatOutputParser,
          budget: ThinkingBudget) -> tuple[str | None, str | None]:
    """``(stop_reason, stop_sequence)`` of the finished (or budget-stopped) choice."""
    choice = started.run.choices[0]
    return stop_reason(choice.finish_reason, choice.stop_reason, bool(parser.calls), budget.over)


def _message(external_id: str, started: conversation.Started, parser: ChatOutputParser | None,
             budget: ThinkingBudget, sign: Callable[[str], str]) -> dict[str, object]:
    """The ``message`` object: with ``parser`` the finished one (content, stop reason), without it the head a stream
    starts with (no content yet, the input usage)."""
    run = started.run
    reason = _stop(started, parser, budget) if parser is not None else (None, None)
    return {"id": external_id, "type": "message", "role": "assistant", "model": run.model.served_model_name,
            "content": message_blocks(parser, sign) if parser is not None else [],
            "stop_reason": reason[0], "stop_sequence": reason[1],
            "usage": usage(run.prompt_tokens, run.num_cached_tokens, run.completion_tokens)}


class CountTokensConsumer(GatewayConsumer):
    """``POST /v1/messages/count_tokens``: ``{"input_tokens"}``, exact (module docstring)."""

    dialect = ANTHROPIC

    async def handle_request(self, body: bytes) -> None:
        pre = await preamble.preamble(self, body, lambda data: validate_body(CountTokensRequest, data), "msg_",
                                      credentials=auth.API_KEY_OR_BEARER)
        async with limits.held(self, pre.ctx, grant=pre.grant):  # nothing generated: the request limits only
            anthropic_version(self)
            req = internal_request(pre.ctx, pre.req)
            model = await preamble.resolve_model(pre.ctx, req.model, generate=True)
            await self.send_json(200, {"input_tokens": await conversation.prompt_tokens(pre.ctx, model, req)})
