"""The conversation seam: steps 3-9 of docs/ARCHITECTURE.md §2 as every chat-shaped route composes them.

Chat Completions (``gateway/endpoints/chat.py``), Messages (``gateway/endpoints/messages.py``) and Responses are
protocol adapters: each parses its own body, turns it into the one internal request
(``inference.protocol.openai.ChatCompletionRequest``: messages, tools, output constraint, sampling, limits), and
writes the started run's parsed output back in its own shapes. What lies between is here, in one order, so a fix in a
step fixes every route:

``opened``  (a context manager) steps 3-4: authenticate where the route reads its key, take the key's request
            limits, parse and validate the route's own body, echo the request id; then hold the request's scope,
            released once on exit whatever the exit (``scope.request_scope``).
``start``   steps 5-9 on the internal request: resolve the model, the key's token estimate and the admission
            pre-check (``flow.hold_before_render``), render and process the input (``flow.render_chat_input``), its
            images' feature keys (``inputs.attach_media``), the exact admission and the engine hand-off
            (``flow.admit_and_start``). Returns the ``Started`` run, its tokenizer and one ``ChatOutputParser`` per
            choice (``output_parsers``).
``prompt_tokens``  steps 7 alone: the exact prompt length of an internal request (count routes).

What differs per route is its ``Route`` (the usage records' endpoint name, the external id's prefix, where the key
is read) and its consumer's error dialect (``GatewayConsumer.dialect``, ``gateway.dialects``), which writes every
error raised here, before the route's first byte.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import AsyncIterator, Callable, Generic, Protocol, TypeVar

from gateway import auth
from gateway.clients import link
from gateway.http import GatewayConsumer
from gateway.model_cache import ModelSnapshot
from gateway.pipeline import flow, inputs, preamble, rendering
from gateway.pipeline.engine import GenerationRun
from gateway.pipeline.media import render_chat_media
from gateway.pipeline.preamble import JsonBody, Preamble
from gateway.pipeline.scope import RequestScope, record_refusal, request_scope
from inference.api.chat_output import ChatOutputParser, ChatOutputSpec
from inference.api.input_processor import new_internal_id
from inference.protocol.openai import ChatCompletionRequest
from inference.renderer.tokenizer_cache import LoadedTokenizer
from tenancy.selectors import AuthContext


class NamesModel(Protocol):
    """A route's validated body: it names the served model (its usage record's until the internal request is
    built)."""

    @property
    def model(self) -> str | None: ...


Body = TypeVar("Body", bound=NamesModel)
"""A route's own validated body (``ChatCompletionRequest`` for chat, ``MessagesRequest`` for messages)."""


@dataclass(frozen=True)
class Route:
    """What differs between the routes that compose the seam: ``endpoint``, the usage records' route name
    (``chat.completions``, ``messages``); ``id_prefix`` before the request id in the external id (``chatcmpl-``,
    ``msg_``); ``credentials``, where the API key is read (``auth.BEARER`` unless the protocol says otherwise)."""

    endpoint: str
    id_prefix: str
    credentials: auth.Credentials = auth.BEARER


@dataclass
class Opened(Generic[Body]):
    """A request past steps 3-4: ``pre`` (the caller, the route's validated body, its ids, the key's grant),
    ``scope`` (what it holds; released when ``opened`` exits) and ``arrival`` (Unix time it was taken up)."""

    pre: Preamble[Body]
    scope: RequestScope
    arrival: float


@dataclass
class Started:
    """A request past step 9: the internal request ``req``, its resolved ``model`` and ``tokenizer``, and the
    started ``run`` (recorded on the scope, which closes it)."""

    req: ChatCompletionRequest
    model: ModelSnapshot
    tokenizer: LoadedTokenizer
    run: GenerationRun

    @cached_property
    def parsers(self) -> list[ChatOutputParser]:
        """One output parser per choice, in choice order (``output_parsers``; made on first use)."""
        return output_parsers(self.run)


@asynccontextmanager
async def opened(consumer: GatewayConsumer, body: bytes, route: Route,
                 schema: type[Body] | Callable[[JsonBody], Body]) -> AsyncIterator[Opened[Body]]:
    """Steps 3-4 for ``route``: ``preamble.preamble`` with the route's credentials (401, 403, 429 before the body is
    parsed, its usage recorded under ``route.endpoint``; 400 naming the field), then the request's scope, held while
    the body runs and released once on any exit (``scope.request_scope``). Its usage record counts 1 choice until
    ``start`` sets the internal request's ``n``."""
    arrival = time.time()
    pre = await preamble.preamble(consumer, body, schema, route.id_prefix, on_refused=record_refusal(route.endpoint),
                                  credentials=route.credentials)
    async with request_scope(route.endpoint, new_internal_id(pre.external_id), arrival, pre.ctx, pre.req.model, 1,
                             grant=pre.grant) as scope:
        yield Opened(pre, scope, arrival)


async def start(consumer: GatewayConsumer, conv: Opened[Body], req: ChatCompletionRequest, *,
                size: int) -> Started:
    """Steps 5-9 of the internal request ``req`` (built by the route from ``conv.pre.req``; ``size``: the body's
    bytes, what the estimates of step 6 are bounded by): resolve its model (400/403/404), hold the key's token
    estimate (429) and the admission pre-check (503), render and process the input (400, 429, 503), attach its
    images' feature keys, admit it exactly (503) and hand it to the engine (503). Every error is an ``ApiError``
    raised before the route's first byte."""
    ctx, scope, n = conv.pre.ctx, conv.scope, req.n or 1
    scope.recorder.n = n
    model = await preamble.resolve_model(ctx, req.model, generate=True)
    await flow.hold_before_render(consumer, scope, ctx, model, n=n, size=size, exact=False,
                                  max_tokens=req.requested_max_tokens[0], request_priority=req.priority,
                                  constrained=inputs.asks_for_constraint(req))
    tokenizer, rendered, processed = await flow.render_chat_input(
        ctx, model, req, external_id=conv.pre.external_id, client_id=link().client_id, arrival_time=conv.arrival)
    inputs.attach_media(processed, rendered.mm_cache_keys)
    run = await flow.admit_and_start(scope, model, tokenizer, processed, stop=req.stop,
                                     include_stop_str_in_output=bool(req.include_stop_str_in_output),
                                     skip_special_tokens=req.skip_special_tokens is not False,
                                     arrival_time=conv.arrival)
    return Started(req, model, tokenizer, run)


async def prompt_tokens(ctx: AuthContext, model: ModelSnapshot, req: ChatCompletionRequest) -> int:
    """The prompt length ``start`` would give ``req`` on ``model``, without generating: the same character bound,
    the same render payload (template, tools, template arguments) and the same image expansion as step 7, so a count
    route (``/v1/messages/count_tokens``) is exact. Raises ``ApiError`` as step 7 does (400, 429, 503)."""
    tokenizer = await rendering.load_tokenizer(model)
    rendering.check_prompt_chars(model, tokenizer, rendering.message_chars(req.messages), "messages")
    rendered = await render_chat_media(model, rendering.chat_render_payload(model, req),
                                       cache_salt=inputs.cache_salt_for(ctx, req.cache_salt), tenant_id=ctx.tenant_id)
    return len(rendered.prompt_token_ids)


def output_parsers(run: GenerationRun) -> list[ChatOutputParser]:
    """One ``ChatOutputParser`` per choice of ``run`` (reasoning, answer, tool calls; ``inference.api.chat_output``),
    as the request's output spec says (none: a parser that passes the text through)."""
    spec: ChatOutputSpec | None = run.processed.chat_output
    return [spec.parser() if spec is not None else ChatOutputParser() for _ in run.choices]
