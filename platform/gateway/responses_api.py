"""The Responses API's work between its routes (``gateway/endpoints/responses.py``) and the background runner
(``gateway/responses_runner.py``): the conversation a request continues, the internal chat request, running a started
response to its end as events, the stored response and the per-response Redis event stream.

A request is an adapter over the conversation seam (``gateway.pipeline.conversation``): its items become the internal
``ChatCompletionRequest`` (``inference.api.responses_input``), ``conversation.start`` runs steps 5-9 on it, and the
parsed output becomes items and events (``inference.api.responses_output``). What is specific here:

* the context: ``previous_response_id`` names one of the caller's stored responses; its chain's items (each
  turn's input, then its output) come first, ``item_reference`` s are looked up among the caller's stored items; an
  unknown id, or another tenant's, is 404 (``load_context``). The whole chain counts in the estimate the key's limits
  and the admission pre-check take (``size``), and the exact prompt length settles them;
* the replica that served the parent is preferred for the follow-up (``inference.api.engine_client.EXPECTED_HIT``),
  so its prefix cache serves the parent's prompt again (``usage.input_tokens_details.cached_tokens``);
* ``truncation: "auto"`` counts the prompt first (``conversation.prompt_tokens``) and drops the oldest turns until it
  fits (``truncated``); ``disabled`` leaves the 400 ``context_length_exceeded`` of step 8, naming ``input``;
* errors of the chat steps name the Responses field (``input[i]``, ``text.format``...: ``chat_param_to_input``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import orjson
from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, connection as db_connection

from gateway.clients import redis
from gateway.errors import ApiError, ErrorCode, bad_request, database_unavailable, not_found
from gateway.http import GatewayConsumer
from gateway.logprobs import chat_logprobs
from gateway.model_cache import ModelSnapshot
from gateway.pipeline import conversation, preamble
from gateway.pipeline.failures import api_error_from
from gateway.pipeline.responses import LogprobCursor
from inference.api.chat_output import ChatDelta, ChatOutputParser
from inference.api.engine_client import EXPECTED_HIT, ExpectedHit
from inference.api.responses_input import (ChatConversion, chat_param_to_input, drop_oldest, items_to_messages,
                                           resolve_references, stored_input_item, stored_items, to_chat_request,
                                           turns_to_drop)
from inference.api.responses_output import (Event, ResponseBuilder, final_status, new_item_id, request_echo,
                                            response_object, terminal_event_type)
from inference.protocol.engine import FINISH_ABORT
from inference.protocol.openai import ChatCompletionRequest, RequestValidationError
from inference.protocol.responses import (STATUS_CANCELLED, STATUS_FAILED, STATUS_IN_PROGRESS,
                                          STATUS_QUEUED, TERMINAL_EVENTS, InputItem, ItemReference,
                                          ResponsesRequest, Usage, usage_object)
from stored_responses.selectors import ChainBrokenError, stored_items_by_ids, stored_response_chain
from stored_responses.services import stored_response_create
from tenancy.selectors import AuthContext

RESPONSES = conversation.Route("responses", "resp_")
"""The route's usage name and the internal ids' prefix (the response's own id is ``new_response_id``'s)."""
MAX_TRUNCATION_ROUNDS = 6
EVENTS_TTL_S = 3600
"""How long a background response's event stream is kept after its last event (resumable that long)."""

Emit = Callable[[list[Event]], Awaitable[None]]
"""Where a running response's events go: an SSE stream, a Redis event stream, or nowhere."""


async def no_emit(events: list[Event]) -> None:
    """An ``Emit`` that drops the events (a non-streamed response: only its final object is sent)."""


def not_found_response(response_id: str, param: str | None = None) -> ApiError:
    """404 for a response id the caller has no (unexpired) response of: not its, deleted, expired or never made."""
    return not_found(f"Response with id '{response_id}' not found.", param)


_STORE_THREADS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="responses-store")


def _on_store_thread(call: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """``call(**kwargs)`` on the store thread's own database connection, kept open between calls (an api process
    stores every response it answers: a connection opened per call, as ``database_sync_to_async`` does under
    ``CONN_MAX_AGE`` 0 on SQLite, cost more CPU than the write); a connection found broken (a database restart) is
    closed and the call made once more on a new one."""
    try:
        return call(**kwargs)
    except (OperationalError, InterfaceError):
        db_connection.close()
        return call(**kwargs)


async def db(call: Callable[..., Any], **kwargs: Any) -> Any:
    """``call(**kwargs)`` (a stored_responses service or selector) on a store thread (``_on_store_thread``); a
    database that cannot be reached is 503 ``database_unavailable``."""
    try:
        return await asyncio.get_running_loop().run_in_executor(_STORE_THREADS, _on_store_thread, call, kwargs)
    except DatabaseError:
        raise database_unavailable() from None


# ----------------------------------------------------------------------------- the conversation a request continues


@dataclass
class ResponseContext:
    """What a request continues and adds: ``items`` (the chain's items, then this request's input, references
    resolved), ``new_items`` (this request's input as stored), ``ancestors`` (the chain's response ids, oldest first:
    the new response's ``ancestors``), ``chain_bytes`` (the chain's JSON size, for the estimates), ``expected`` (the
    parent's replica and prompt length)."""

    items: list[InputItem]
    new_items: list[dict[str, Any]]
    ancestors: list[str] = field(default_factory=list)
    chain_bytes: int = 0
    expected: ExpectedHit | None = None


def _load_sync(*, tenant_id: int, req: ResponsesRequest) -> tuple[Any, dict[str, dict[str, Any]]]:
    chain = None
    if req.previous_response_id is not None:
        chain = stored_response_chain(tenant_id=tenant_id, response_id=req.previous_response_id)
    refs = [i.id for i in req.input_items if isinstance(i, ItemReference)]
    return chain, (stored_items_by_ids(tenant_id=tenant_id, item_ids=refs) if refs else {})


async def load_context(ctx: AuthContext, req: ResponsesRequest) -> ResponseContext:
    """The conversation ``req`` continues (``ResponseContext``). 404 when ``previous_response_id`` is not one of the
    caller's stored responses; 400 when its chain was partly deleted, it has not finished, or an ``item_reference``
    names no stored item of the caller."""
    try:
        chain, refs = None, {}
        if req.previous_response_id is not None or any(isinstance(i, ItemReference) for i in req.input_items):
            chain, refs = await db(_load_sync, tenant_id=ctx.tenant_id, req=req)
    except ChainBrokenError as exc:
        raise bad_request(f"The conversation of previous_response_id cannot be rebuilt: {exc}",
                          "previous_response_id") from None
    try:
        new = resolve_references(req.input_items, refs)
    except RequestValidationError as exc:
        raise api_error_from(exc) from None
    new_items = [stored_input_item(item, new_item_id) for item in new]
    if chain is None:
        if req.previous_response_id is not None:
            raise not_found_response(req.previous_response_id, "previous_response_id")
        return ResponseContext(new, new_items)
    if chain.tip.status in (STATUS_QUEUED, STATUS_IN_PROGRESS):
        raise bad_request(f"Response '{chain.tip.response_id}' is still {chain.tip.status}: continue it once it has "
                          "ended", "previous_response_id")
    expected = ExpectedHit(chain.tip.engine_id, chain.tip.prompt_tokens) if chain.tip.engine_id else None
    return ResponseContext(stored_items(chain.items) + new, new_items, chain.ids,
                           sum(len(orjson.dumps(i)) for i in chain.items), expected)


def internal_request(req: ResponsesRequest, context: ResponseContext, request_id: str | None
                     ) -> tuple[ChatConversion, ChatCompletionRequest]:
    """The chat conversation and the internal request of ``req`` over ``context`` (400 naming the field)."""
    try:
        conv = items_to_messages(context.items, req.instructions)
        return conv, to_chat_request(req, conv, request_id=request_id)
    except RequestValidationError as exc:
        raise api_error_from(exc) from None


def renamed(err: ApiError, conv: ChatConversion) -> ApiError:
    """``err`` of a chat step with its field named as the Responses request names it."""
    err.param = chat_param_to_input(err.param, conv)
    return err


async def truncated(ctx: AuthContext, model: ModelSnapshot, req: ResponsesRequest, conv: ChatConversion,
                    chat: ChatCompletionRequest) -> tuple[ChatConversion, ChatCompletionRequest]:
    """``truncation: "auto"``: the oldest turns dropped until the prompt leaves room for ``max_output_tokens`` (one
    token without it) in ``max_model_len``; counted as step 7 renders it. 400 ``context_length_exceeded`` (``input``)
    when the newest input alone does not fit."""
    budget = int(model.max_model_len) - max(1, req.max_output_tokens or 1)
    current, dropped = conv, 0
    for _ in range(MAX_TRUNCATION_ROUNDS):
        try:
            n = await conversation.prompt_tokens(ctx, model, chat)
        except ApiError as err:
            if err.code != ErrorCode.CONTEXT_LENGTH_EXCEEDED:  # too many characters to count: drop a turn
                raise renamed(err, current) from None
            n = budget + 1
        if n <= budget:
            return current, chat
        dropped += max(1, turns_to_drop(current.messages, n, budget))
        shorter = drop_oldest(conv, dropped)
        if shorter is None:
            break
        current = shorter
        chat = to_chat_request(req, current, request_id=chat.request_id)
    raise bad_request(f"The input does not fit this model's context of {model.max_model_len} tokens even with the "
                      "oldest items dropped (truncation 'auto')", "input", ErrorCode.CONTEXT_LENGTH_EXCEEDED)


async def start(consumer: GatewayConsumer, conv: conversation.Opened[Any], req: ResponsesRequest,
                context: ResponseContext, *, size: int) -> tuple[conversation.Started, ChatConversion]:
    """Steps 5-9 of ``req`` over ``context`` (``conversation.start``), the parent's replica preferred, errors naming
    the Responses fields; truncated first with ``truncation: "auto"``."""
    chat_conv, chat = internal_request(req, context, conv.pre.external_id)
    if req.truncation == "auto":
        model = await preamble.resolve_model(conv.pre.ctx, chat.model, generate=True)
        chat_conv, chat = await truncated(conv.pre.ctx, model, req, chat_conv, chat)
    token = EXPECTED_HIT.set(context.expected)
    try:
        return await conversation.start(consumer, conv, chat, size=size + context.chain_bytes), chat_conv
    except ApiError as err:
        raise renamed(err, chat_conv) from None
    finally:
        EXPECTED_HIT.reset(token)


# ----------------------------------------------------------------------------- running a started response


@dataclass
class ResponseRecord:
    """What a response object repeats besides its output: its id, creation time, model, the request's echoed
    parameters, chain, metadata and flags."""

    response_id: str
    created_at: float
    model: str
    echo: dict[str, Any]
    previous_response_id: str | None
    metadata: dict[str, str]
    background: bool
    store: bool

    @classmethod
    def of(cls, response_id: str, created_at: float, req: ResponsesRequest) -> ResponseRecord:
        """The record of a new response to ``req``."""
        return cls(response_id, created_at, req.model or "", request_echo(req), req.previous_response_id,
                   dict(req.metadata or {}), bool(req.background), req.store is not False)

    def body(self, status: str, output: list[dict[str, Any]], usage: Usage | None = None, *,
             completed_at: float | None = None, error: dict[str, Any] | None = None,
             incomplete_details: dict[str, str] | None = None) -> dict[str, Any]:
        """The ``response`` object in ``status`` with ``output`` and ``usage``."""
        return response_object(response_id=self.response_id, created_at=self.created_at, model=self.model,
                                status=status, echo=self.echo, output=output, usage=usage,
                                previous_response_id=self.previous_response_id, metadata=self.metadata,
                                background=self.background, store=self.store, completed_at=completed_at,
                                error=error, incomplete_details=incomplete_details)


@dataclass
class Outcome:
    """How a response ended: ``status``, ``usage``, and ``error`` or ``incomplete_details``."""

    status: str
    usage: Usage
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    completed_at: float = field(default_factory=time.time)


def response_error(err: ApiError) -> dict[str, Any]:
    """A failed response's ``error`` (the SDK's ``ResponseError`` codes: ``rate_limit_exceeded`` for 429,
    ``invalid_prompt`` for 400, else ``server_error``)."""
    code = "rate_limit_exceeded" if err.status == 429 else "invalid_prompt" if err.status == 400 else "server_error"
    return {"code": code, "message": err.message}


def reasoning_tokens(started: conversation.Started, parser: ChatOutputParser) -> int:
    """Reasoning tokens of the (one) choice; 0 without a reasoning parser."""
    return parser.reasoning_tokens(started.run.choices[0].token_ids) or 0


def run_usage(started: conversation.Started, parser: ChatOutputParser) -> Usage:
    """The response's ``usage`` from its run: the whole prompt, the cached part, the output and its reasoning."""
    run = started.run
    return usage_object(run.prompt_tokens, run.completion_tokens, run.num_cached_tokens,
                        reasoning_tokens(started, parser))


async def drive(started: conversation.Started, req: ResponsesRequest, builder: ResponseBuilder, emit: Emit) -> Outcome:
    """Run the started response to its end: each engine delta parsed (reasoning, answer, calls) into items and
    events (``emit``), then the open item closed. An engine failure after the start is an ``error`` event and status
    ``failed``; an abort (cancel) leaves status ``cancelled``."""
    run, parser = started.run, started.parsers[0]
    cursor = LogprobCursor(run) if req.wants_logprobs else None
    top = req.top_logprobs or 0
    async for d in run.deltas():
        state = run.choices[d.index]
        if state.finish_reason == "error":
            break
        out = parser.push(d.text) if d.text else ChatDelta()
        if d.finish_reason is not None:
            tail = parser.finish()
            out = ChatDelta(out.reasoning + tail.reasoning, out.content + tail.content, out.calls + tail.calls)
        logprobs = None
        if cursor is not None and out.content:
            ids, lps = cursor.take(state)
            logprobs = (chat_logprobs(started.tokenizer, ids, lps, top) or {}).get("content")
        events = builder.push(out, logprobs)
        if events:
            await emit(events)
    try:
        run.raise_for_engine_error(retry_after=False)
    except ApiError as err:
        await emit([builder.error(err.message, err.code, err.param)] + builder.finish(STATUS_FAILED))
        return Outcome(STATUS_FAILED, run_usage(started, parser), error=response_error(err))
    reason = run.choices[0].finish_reason
    if reason == FINISH_ABORT:
        await emit(builder.finish(STATUS_CANCELLED))
        return Outcome(STATUS_CANCELLED, run_usage(started, parser))
    status, details = final_status(parser.finish_reason(reason))
    await emit(builder.finish(status))
    return Outcome(status, run_usage(started, parser), incomplete_details=details)


def stored_time(t: float | None) -> datetime | None:
    """A Unix time as the aware datetime the store keeps (``None`` stays ``None``)."""
    return None if t is None else datetime.fromtimestamp(t, timezone.utc)




async def store(ctx: AuthContext, record: ResponseRecord, context: ResponseContext, output: list[dict[str, Any]],
                outcome: Outcome, started: conversation.Started) -> None:
    """Store a finished foreground response with its input and output items (``store: true``), before its body or
    last event goes out, so a follow-up sent as soon as it is read finds it."""
    kwargs = dict(
        response_id=record.response_id, tenant_id=ctx.tenant_id, api_key_id=ctx.key_id, model=record.model,
        status=outcome.status, created_at=stored_time(record.created_at), input_items=context.new_items,
        output_items=output, previous_response_id=record.previous_response_id, ancestors=context.ancestors,
        params=record.echo, metadata=record.metadata, usage=outcome.usage, error=outcome.error,
        incomplete_details=outcome.incomplete_details, engine_id=started.run.engine_id or "",
        prompt_tokens=started.run.prompt_tokens, completed_at=stored_time(outcome.completed_at))
    await db(stored_response_create, **kwargs)


def final_body(record: ResponseRecord, builder: ResponseBuilder, outcome: Outcome) -> dict[str, Any]:
    """The finished response object."""
    return record.body(outcome.status, builder.output, outcome.usage, completed_at=outcome.completed_at,
                       error=outcome.error, incomplete_details=outcome.incomplete_details)


def final_event(record: ResponseRecord, builder: ResponseBuilder, outcome: Outcome) -> Event:
    """The stream's last event: ``response.completed``, ``.incomplete`` or ``.failed`` (also for ``cancelled``: the
    SDK has no event of its own for it; the response inside says ``cancelled``)."""
    return builder.lifecycle(terminal_event_type(outcome.status), final_body(record, builder, outcome))


# ----------------------------------------------------------------------------- SSE and the Redis event stream


def sse(event: Event) -> bytes:
    """One event as SSE: ``event: <type>`` and ``data: <json>``."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def sse_emitter(consumer: GatewayConsumer) -> Emit:
    """An ``Emit`` writing to ``consumer``'s open SSE response."""

    async def emit(events: list[Event]) -> None:
        await consumer.send_body(b"".join(sse(e) for e in events), more_body=True)

    return emit


def events_key(response_id: str) -> str:
    """The Redis stream of a background response's events: entry id ``<sequence_number + 1>-0``, field ``e`` the
    event's JSON."""
    return f"{settings.LINK_PREFIX}:responses:events:{response_id}"


def stream_emitter(response_id: str) -> Emit:
    """An ``Emit`` appending to the response's Redis event stream (``events_key``). Each entry's id is the event's
    ``sequence_number`` + 1, so an event appended twice (a retried write) is refused by Redis and a reader resumes
    exactly after the last one it saw."""
    key = events_key(response_id)

    async def emit(events: list[Event]) -> None:
        async with redis().pipeline(transaction=False) as pipe:
            for e in events:
                pipe.xadd(key, {"e": orjson.dumps(e)}, id=f"{int(e['sequence_number']) + 1}-0")
            pipe.expire(key, EVENTS_TTL_S)
            await pipe.execute(raise_on_error=False)

    return emit


async def last_sequence_number(response_id: str) -> int:
    """The ``sequence_number`` of the last event in the response's stream (-1: none)."""
    last: Any = await redis().xrevrange(events_key(response_id), count=1)
    return int(bytes(last[0][0]).split(b"-")[0]) - 1 if last else -1


async def tail(consumer: GatewayConsumer, response_id: str, after: int, *, block_ms: int = 1000,
               give_up: Callable[[], Awaitable[bool]] | None = None) -> None:
    """Send the response's events after ``sequence_number`` ``after`` as SSE on ``consumer`` (already started), as
    they are appended, until its last (terminal) event. ``give_up()`` is asked whenever nothing came for
    ``block_ms``: True ends the stream (the response ended without its events, e.g. its stream expired)."""
    key, last = events_key(response_id), f"{after + 1}-0"
    client = redis()
    while True:
        reply: Any = await client.xread({key: last}, count=256, block=block_ms)
        if not reply:
            if give_up is not None and await give_up():
                return
            continue
        chunks, done = [], False
        for _key, entries in reply:
            for entry_id, fields in entries:
                last = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                data = bytes(fields[b"e"])
                kind = _event_type(data)
                chunks.append(b"event: " + kind + b"\ndata: " + data + b"\n\n")
                done = done or kind.decode() in TERMINAL_EVENTS
        await consumer.send_body(b"".join(chunks), more_body=True)
        if done:
            return


def _event_type(data: bytes) -> bytes:
    """The ``type`` of an event's JSON (it is the first key: ``ResponseBuilder.event`` writes it first)."""
    start = data.index(b'"type":"') + 8
    return data[start:data.index(b'"', start)]


async def end_stream(consumer: GatewayConsumer) -> None:
    """Close an SSE response (no ``[DONE]``: the Responses stream ends with its terminal event)."""
    await consumer.send_body(b"", more_body=False)


def error_event_bytes(builder: ResponseBuilder, err: ApiError) -> bytes:
    """An in-band ``error`` event for a failure after the 200 that ``drive`` did not turn into events itself."""
    return sse(builder.error(err.message, err.code, err.param))

