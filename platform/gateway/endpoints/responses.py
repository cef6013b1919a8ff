"""The OpenAI Responses API (``openai/resources/responses``): ``POST /v1/responses``, ``GET`` / ``DELETE
/v1/responses/{id}`` (``?stream=true&starting_after=N`` replays a background response's events),
``POST /v1/responses/{id}/cancel``, ``GET /v1/responses/{id}/input_items`` and ``POST /v1/responses/input_tokens``.

``POST /v1/responses`` is an adapter over the conversation seam (``gateway.pipeline.conversation``; the Responses
parts in ``gateway.responses_api``): the same steps as chat completions, errors in OpenAI's envelope before the first
byte, a stream of semantic events (``event: <type>``, gap-free ``sequence_number``, no ``[DONE]``) after it, an
``error`` event then ``response.failed`` for a failure once streaming. ``store`` (default true) keeps the response
and its items (``stored_responses``) before its body or last event goes out; ``store: false`` writes nothing.
``background: true`` stores the response ``queued``, writes its first events to its Redis event stream and hands it
to the background runner (``gateway.responses_runner``, another process), which runs it to its end; this process
answers at once (or, with ``stream``, tails the event stream as any api process can).

Every route reads only the caller's tenant's responses: another tenant's id is 404, as an unknown one.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import parse_qs

from gateway.errors import ApiError, bad_request
from gateway.http import GatewayConsumer
from gateway.pipeline import conversation, limits, preamble
from gateway.pipeline.failures import api_error_from
from gateway.responses_api import (RESPONSES, Emit, db, ResponseContext, ResponseRecord, drive, end_stream, error_event_bytes,
                                   final_body, final_event, internal_request, load_context, no_emit, not_found_response,
                                   renamed, sse, sse_emitter, start, store, stored_time, stream_emitter, tail,
                                   truncated)
from gateway.responses_runner import cancel_signal, enqueue, job_payload, stored_body, stored_finished
from inference.api.responses_output import ResponseBuilder, new_response_id
from inference.protocol.openai import RequestValidationError
from inference.protocol.responses import (EV_CREATED, EV_IN_PROGRESS, EV_QUEUED, RESPONSE_ID_RE, STATUS_FAILED,
                                          STATUS_IN_PROGRESS, STATUS_QUEUED, InputItemsQuery, ResponsesRequest,
                                          validate_at, validate_responses_request)
from stored_responses.selectors import stored_input_items_page, stored_response_get
from stored_responses.services import stored_response_cancel, stored_response_create, stored_response_delete
from tenancy.selectors import AuthContext


CANCEL_SETTLE_S = 5.0


class ResponsesConsumer(GatewayConsumer):
    """``POST /v1/responses``: foreground (streamed or not) or background."""

    _builder: ResponseBuilder | None = None

    async def handle_request(self, body: bytes) -> None:
        async with conversation.opened(self, body, RESPONSES, validate_responses_request) as conv:
            req, ctx = conv.pre.req, conv.pre.ctx
            record = ResponseRecord.of(new_response_id(), conv.arrival, req)
            context = await load_context(ctx, req)
            if req.background:
                await self._background(conv, record, context, len(body))
                return
            started, _conv = await start(self, conv, req, context, size=len(body))
            record.model = started.model.served_model_name
            builder = self._builder = ResponseBuilder()
            emit: Emit = no_emit
            if req.stream:
                await self.start_sse()
                emit = sse_emitter(self)
                await emit([builder.lifecycle(EV_CREATED, record.body(STATUS_IN_PROGRESS, [])),
                            builder.lifecycle(EV_IN_PROGRESS, record.body(STATUS_IN_PROGRESS, []))])
            outcome = await drive(started, req, builder, emit)
            if outcome.status == STATUS_FAILED and not req.stream:
                started.run.raise_for_engine_error(retry_after=True)  # before any byte: a real 503
            if record.store:
                await store(ctx, record, context, builder.output, outcome, started)
            if req.stream:
                await self.send_body(sse(final_event(record, builder, outcome)), more_body=True)
                await end_stream(self)
            else:
                answer = final_body(record, builder, outcome)
                if req.return_token_ids:
                    answer["prompt_token_ids"] = started.run.processed.prompt_token_ids
                await self.send_json(200, answer)

    async def _background(self, conv: conversation.Opened[ResponsesRequest], record: ResponseRecord,
                          context: ResponseContext, size: int) -> None:
        """Check what can be checked now (the conversation converts, the model resolves: 400/403/404 before the
        200), store the response ``queued`` with the job its runner needs, write its first events, queue it, and
        answer with it (or its events, with ``stream``). Its usage is recorded by the runner, under this request's
        id: this process's record is dropped, so the request is counted and billed once."""
        req, ctx = conv.pre.req, conv.pre.ctx
        _chat_conv, chat = internal_request(req, context, conv.pre.external_id)
        model = await preamble.resolve_model(ctx, chat.model, generate=True)
        record.model = model.served_model_name
        job = job_payload(req, ctx, conv.scope.recorder.request_id, conv.pre.external_id, size, context)
        await db(stored_response_create, response_id=record.response_id, tenant_id=ctx.tenant_id,
                 api_key_id=ctx.key_id, model=record.model, status=STATUS_QUEUED,
                 created_at=stored_time(record.created_at), input_items=context.new_items, background=True,
                 previous_response_id=record.previous_response_id, ancestors=context.ancestors, params=record.echo,
                 metadata=record.metadata, request=job)
        builder = ResponseBuilder()
        queued = record.body(STATUS_QUEUED, [])
        await stream_emitter(record.response_id)([builder.lifecycle(EV_CREATED, queued),
                                                  builder.lifecycle(EV_QUEUED, queued)])
        await enqueue(record.response_id)
        conv.scope.recorder.ctx = None  # the runner emits this request's usage event (same request id)
        if not req.stream:
            await self.send_json(200, queued)
            return
        await self.start_sse()
        await tail(self, record.response_id, -1, give_up=stored_finished(ctx.tenant_id, record.response_id))
        await end_stream(self)

    async def send_sse_error(self, err: ApiError) -> None:
        """A failure after the 200 that ``drive`` did not turn into events: an ``error`` event, then the end of the
        stream (no ``[DONE]``)."""
        try:
            await self.send_body(error_event_bytes(self._builder or ResponseBuilder(), err), more_body=True)
            await end_stream(self)
        except Exception:  # noqa: BLE001 - the client may be gone
            pass


def _response_id(consumer: GatewayConsumer) -> str:
    """The ``{id}`` of the route; a string that cannot be a response id is 404 at once."""
    rid = str(consumer.scope["url_route"]["kwargs"]["response_id"])
    if not RESPONSE_ID_RE.fullmatch(rid):
        raise not_found_response(rid[:80])
    return rid


def _query(consumer: GatewayConsumer) -> dict[str, str]:
    """The query string's parameters (the last value of each)."""
    parsed = parse_qs(consumer.scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    return {k: v[-1] for k, v in parsed.items()}


async def _owned(ctx: AuthContext, rid: str) -> Any:
    """The caller's response ``rid``; 404 otherwise."""
    resp = await db(stored_response_get, tenant_id=ctx.tenant_id, response_id=rid)
    if resp is None:
        raise not_found_response(rid)
    return resp


class ResponseConsumer(GatewayConsumer):
    """``GET /v1/responses/{id}`` (``?stream=true&starting_after=N``: a background response's events after ``N``)
    and ``DELETE /v1/responses/{id}`` (the response and its items; a running background response is cancelled)."""

    methods = ("GET", "DELETE")

    async def handle_request(self, body: bytes) -> None:
        ctx = await preamble.authenticate(self)
        rid = _response_id(self)
        async with limits.held(self, ctx):
            if self.scope.get("method") == "DELETE":
                deleted = await db(stored_response_delete, tenant_id=ctx.tenant_id, response_id=rid)
                if not deleted:
                    raise not_found_response(rid)
                await cancel_signal(rid)
                await self.send_json(200, {"id": rid, "object": "response", "deleted": True})
                return
            query = _query(self)
            resp = await _owned(ctx, rid)
            if query.get("stream", "false").lower() != "true":
                await self.send_json(200, await stored_body(resp))
                return
            if not resp.background:
                raise bad_request("Only background responses can be streamed again: this one was not created with "
                                  "'background': true", "stream")
            after = _int_param(query.get("starting_after", "-1"), "starting_after")
            await self.start_sse()
            await tail(self, rid, after, give_up=stored_finished(ctx.tenant_id, rid))
            await end_stream(self)


def _int_param(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise bad_request(f"'{name}' must be an integer, got {value[:40]!r}", name) from None


class CancelConsumer(GatewayConsumer):
    """``POST /v1/responses/{id}/cancel``: only a background response can be cancelled (400 otherwise); its engine
    work is aborted and the tokens generated until then are billed. A response that already ended is returned as it
    is."""

    async def handle_request(self, body: bytes) -> None:
        ctx = await preamble.authenticate(self)
        rid = _response_id(self)
        async with limits.held(self, ctx):
            resp = await _owned(ctx, rid)
            if not resp.background:
                raise bad_request("Only responses created with 'background': true can be cancelled", "response_id")
            if await db(stored_response_cancel, tenant_id=ctx.tenant_id, response_id=rid):
                await cancel_signal(rid)
                resp = await _settled(ctx, rid)
            await self.send_json(200, await stored_body(resp))


async def _settled(ctx: AuthContext, rid: str) -> Any:
    """The cancelled response once its runner has stored what it generated until the abort (its usage), at most
    ``CANCEL_SETTLE_S`` later; as it is then otherwise (a runner that is down settles it when it is back)."""
    deadline = time.monotonic() + CANCEL_SETTLE_S
    while True:
        resp = await _owned(ctx, rid)
        if resp.completed_at is not None or time.monotonic() > deadline:
            return resp
        await asyncio.sleep(0.05)


class InputItemsConsumer(GatewayConsumer):
    """``GET /v1/responses/{id}/input_items``: the response's input items, a cursor page (``after``, ``before``,
    ``limit`` 1-100, default 20, ``order`` ``asc``/``desc``, default ``desc``)."""

    methods = ("GET",)

    async def handle_request(self, body: bytes) -> None:
        ctx = await preamble.authenticate(self)
        rid = _response_id(self)
        async with limits.held(self, ctx):
            data: dict[str, Any] = dict(_query(self))
            if "limit" in data:
                data["limit"] = _int_param(data["limit"], "limit")
            try:
                page = validate_at(InputItemsQuery, data, "")
            except RequestValidationError as exc:
                raise api_error_from(exc) from None
            resp = await _owned(ctx, rid)
            found = await db(stored_input_items_page, response=resp, after=page.after, before=page.before,
                             limit=page.limit, order=page.order)
            if found is None:
                raise bad_request("'after' and 'before' must be ids of this response's input items", "after")
            items, more = found
            await self.send_json(200, {"object": "list", "data": items, "has_more": more,
                                       "first_id": items[0]["id"] if items else None,
                                       "last_id": items[-1]["id"] if items else None})


class InputTokensConsumer(GatewayConsumer):
    """``POST /v1/responses/input_tokens``: ``{"object": "response.input_tokens", "input_tokens"}``, the prompt a
    ``POST /v1/responses`` with this body would render (its chain, instructions, tools and truncation), exactly as
    step 7 counts it. Nothing is generated: the key's request limits only."""

    async def handle_request(self, body: bytes) -> None:
        ctx = await preamble.authenticate(self)
        async with limits.held(self, ctx):
            preamble.echo_request_id(self, preamble.client_request_id(self.header(b"x-request-id"), None))
            req = await preamble.parse(body, validate_responses_request)
            context = await load_context(ctx, req)
            chat_conv, chat = internal_request(req, context, None)
            model = await preamble.resolve_model(ctx, chat.model, generate=True)
            if req.truncation == "auto":
                chat_conv, chat = await truncated(ctx, model, req, chat_conv, chat)
            try:
                count = await conversation.prompt_tokens(ctx, model, chat)
            except ApiError as err:
                raise renamed(err, chat_conv) from None
            await self.send_json(200, {"object": "response.input_tokens", "input_tokens": count})
