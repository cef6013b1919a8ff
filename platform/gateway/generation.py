"""The generation service behind chat and completions (DESIGN.md §2, steps 3-11).

Endpoint modules parse and validate; this module resolves the model, renders and tokenizes through the
Celery ``render`` queue, runs input processing, hands the requests to the engine link, turns engine outputs
into text (incremental detokenization, stop strings) and records usage exactly once.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from django.conf import settings

from gateway import auth
from gateway.errors import ApiError, bad_request, not_found, unavailable
from gateway.http import OFF_LOOP_PARSE_BYTES, json_body
from gateway.model_cache import get_model
from inference.admission import Admission, AdmissionRefused, Reservation, estimate_prompt_tokens
from inference.engine_client import EngineLink, EngineUnavailableError
from inference.input_processor import ProcessedInput, model_vocab_size
from inference.output_processor import IncrementalDetokenizer, StopChecker
from inference.protocol.engine import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, EngineCoreOutput
from inference.protocol.openai import MAX_REQUEST_ID_LEN, RequestValidationError, validate_request
from inference.render_client import RenderReplyWaiter, RenderUnavailableError
from inference.renderer.tokenizer_cache import get_tokenizer
from tenancy.limits import (
    RateLimitExceeded,
    grant_headers,
    limits_acquire,
    limits_reservation,
    limits_settle,
)
from usage.events import usage_event_emit

log = logging.getLogger(__name__)

RENDER_QUEUE = "render"


def link() -> EngineLink:
    """This process's engine link."""
    return EngineLink.for_current_process(settings.REDIS_URL, settings.LINK_PREFIX)


def admission() -> Admission:
    """This process's shared-admission client (DESIGN.md §3)."""
    return Admission.for_current_process(settings.REDIS_URL, settings.LINK_PREFIX)


def overloaded(exc: AdmissionRefused) -> ApiError:
    """An admission refusal as HTTP 503 ``server_overloaded`` with ``Retry-After``."""
    return unavailable(exc.message, exc.retry_after_s, "server_overloaded")


async def admission_precheck(model: dict, request_id: str, n: int, size: int, exact: bool = False) -> Reservation:
    """Provisional reservation before rendering; 503 when refused.

    ``size``: an upper bound of the prompt's tokens known before rendering (the body's or the prompt
    text's bytes, or with ``exact`` the length of a token-id prompt); see ``estimate_prompt_tokens``.
    """
    try:
        return await admission().precheck(model["served_model_name"], request_id, n,
                                          estimate_prompt_tokens(size, model["max_model_len"], exact=exact))
    except AdmissionRefused as exc:
        raise overloaded(exc) from None


async def admission_reserve(reservation: Reservation, processed: ProcessedInput) -> None:
    """Settle ``reservation`` to the exact ``n × prompt_tokens`` after tokenizing; 503 when refused."""
    try:
        await admission().reserve(reservation.model, reservation.request_id, len(processed.requests),
                                  len(processed.prompt_token_ids), reservation=reservation)
    except AdmissionRefused as exc:
        raise overloaded(exc) from None


async def admission_release(reservation: Reservation | None) -> None:
    """Release what ``reservation`` still holds (idempotent; errors are logged, never raised)."""
    if reservation is None or reservation.released:
        return
    try:
        await asyncio.shield(admission().release(reservation))
    except Exception:  # noqa: BLE001 - the lease reaper is the backstop
        log.exception("admission release failed for %s", reservation.request_id)


def client_request_id(header_value: bytes | None, body_value: str | None) -> str:
    """The client's request id: ``X-Request-Id`` header, else body ``request_id``, else random.

    Capped at ``MAX_REQUEST_ID_LEN`` characters: a longer value, or a header value with control characters
    (it is echoed as a header), raises ``ApiError`` 400 (param ``X-Request-Id`` or ``request_id``); only
    printable ASCII is kept.
    """
    raw = None
    if header_value:
        raw = header_value.decode("latin-1")
        if len(raw) > MAX_REQUEST_ID_LEN:
            raise bad_request(f"X-Request-Id is longer than {MAX_REQUEST_ID_LEN} characters", "X-Request-Id")
        if any(ord(ch) < 32 or ord(ch) == 127 for ch in raw):
            raise bad_request("X-Request-Id must not contain control characters", "X-Request-Id")
    elif body_value:
        if len(body_value) > MAX_REQUEST_ID_LEN:  # the schemas cap it too; this keeps every caller bounded
            raise bad_request(f"request_id is longer than {MAX_REQUEST_ID_LEN} characters", "request_id")
        raw = body_value
    if raw:
        cleaned = "".join(ch for ch in raw if 32 < ord(ch) < 127)
        if cleaned:
            return cleaned
    return secrets.token_hex(8)


async def validated_body(body: bytes, validate: Callable[[dict], Any]) -> Any:
    """``validate(await json_body(body))``: the validation too runs in a worker thread when the body is over
    ``OFF_LOOP_PARSE_BYTES``, as its parsing does (validating a large body, e.g. 2,048 messages or a long
    token-id list, takes milliseconds: not on the event loop). Raises what they raise
    (``RequestValidationError``)."""
    data = await json_body(body)
    if len(body) > OFF_LOOP_PARSE_BYTES:
        return await asyncio.to_thread(validate, data)
    return validate(data)


async def authenticated_request(consumer, body: bytes, schema, id_prefix: str):
    """The first steps every inference endpoint shares (DESIGN.md §2 steps 1-2): authenticate the key (401,
    403 without the ``inference`` scope), parse and validate ``body`` into ``schema`` (400 naming the field),
    and echo the client's request id. Returns ``(ctx, req, external_id)``; ``external_id`` is
    ``id_prefix + <client or random id>``."""
    ctx = await auth.authenticate(consumer.scope["headers"])
    auth.require_scope(ctx, "inference")
    try:
        req = await validated_body(body, functools.partial(validate_request, schema))
    except RequestValidationError as exc:
        raise to_request_error(exc) from None
    base_id = client_request_id(consumer.header(b"x-request-id"), req.request_id)
    consumer.extra_headers.append((b"x-request-id", base_id.encode()))  # the client's id, echoed as sent
    return ctx, req, id_prefix + base_id


async def resolve_model(ctx, name: str | None) -> dict:
    """The served model for ``name`` (404 when unknown, 403 when the key may not use it)."""
    if not name:
        raise bad_request("'model' is required", "model")
    snap = await get_model(name)
    if snap is None:
        raise not_found(f"The model '{name}' does not exist or is not served here", "model", "model_not_found")
    auth.require_model(ctx, name)
    return snap


async def load_tokenizer(model: dict):
    """The model's tokenizer, loaded once per process off the event loop."""
    return await asyncio.to_thread(get_tokenizer, model["tokenizer_dir"])


async def call_render(task: str, payload: dict[str, Any]) -> dict[str, Any]:
    """Run a renderer task on the Celery ``render`` queue and return its ``ok`` result.

    Structured task errors become HTTP 400 with the renderer's ``param``; no worker answering within the
    time limit, or a worker that ran out of time outside the template (``RenderOverloadedError``), becomes 503.
    """
    from config.celery import app  # the Celery app lives in the Django config package

    from gateway.render import call_inline, runs_inline  # same task body, in-process (RENDER_ROUTE, small tasks)

    if runs_inline(task, payload):
        result = await call_inline(task, payload)
    else:
        timeout = float(getattr(settings, "RENDER_WAIT_TIMEOUT_S", 20.0))
        waiter = RenderReplyWaiter.for_current_loop(settings.REDIS_URL, settings.LINK_PREFIX)
        try:
            result = await waiter.call(app, task, payload, queue=RENDER_QUEUE, timeout=timeout)
        except RenderUnavailableError as exc:
            raise unavailable(f"{exc}: the render workers are busy or down, or the input could not be rendered "
                          f"within the render time limit", 2, "render_unavailable") from None
    if not result.get("ok"):
        if (result.get("error") or {}).get("type") == "InternalError":
            raise ApiError(500, "The renderer failed unexpectedly", "server_error", None, "render_internal_error")
        err = result.get("error") or {}
        etype = err.get("type", "RenderError")
        message = err.get("message") or "The request could not be rendered"
        if etype == "RenderOverloadedError":
            raise unavailable(message, 2, "render_unavailable")
        code = {"TemplateTimeoutError": "template_timeout", "NoChatTemplateError": "no_chat_template",
                "TemplateSecurityError": "template_security", "TemplateLimitError": "template_limit"}.get(
            etype, "invalid_prompt")
        raise bad_request(message, err.get("param"), code)
    return result


def check_prompt_chars(model: dict, tokenizer, n_chars: int, param: str) -> None:
    """Refuse, before rendering or tokenizing, text that cannot fit the context whatever its tokenization:
    more than ``max_model_len × (longest token string in the vocabulary)`` characters (vLLM's character
    pre-check, reference/vllm_frontend.md §3.3 step 2). Keeps a huge prompt from holding a render worker.
    Raises ``ApiError`` 400 with both numbers."""
    bound = int(model["max_model_len"]) * max(1, int(getattr(tokenizer, "max_token_chars", 0) or 0))
    if bound and n_chars > bound:
        raise bad_request(
            f"The input has {n_chars} characters, more than can fit this model's maximum context length of "
            f"{model['max_model_len']} tokens (at most {bound} characters). Please reduce the length of the "
            f"input.", param, "context_length_exceeded")


def message_chars(messages) -> int:
    """Characters of text in chat ``messages`` (string contents and text parts)."""
    total = 0
    for m in messages:
        content = m.content
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return total


def chat_template_for(model: dict, req) -> str | None:
    """The template to render with: request template (only if the registry allows it), else the registry
    override, else ``None`` (the tokenizer's own)."""
    if req.chat_template is not None:
        if not model.get("allow_request_chat_template"):
            raise bad_request("Client-supplied chat templates are not allowed for this model", "chat_template",
                              "chat_template_not_allowed")
        return req.chat_template
    return model.get("chat_template") or None


def cache_salt_for(ctx, request_salt: str | None = None) -> str:
    """The cache salt of a request (issue 14): 64 hex characters, SHA-256 over the caller's cache scope
    (``AuthContext.cache_scope``: its tenant, or the operator-set cache group it shares) and, when given, the
    request's own ``cache_salt`` (vLLM's field, which narrows sharing further; it never replaces the tenant
    part). Carried as ``EngineCoreRequest.cache_salt`` into the first prefix-cache block hash, and mixed into
    the image feature-cache keys, so cached prefixes and image features are shared only within one scope
    (and one request salt) and ``cached_tokens`` tells a caller nothing about other tenants' prompts."""
    h = hashlib.sha256(b"llmp-cache-salt\x00" + ctx.cache_scope.encode())
    if request_salt:
        h.update(b"\x00request:" + request_salt.encode())
    return h.hexdigest()


def vocab_size_of(tokenizer, model: dict) -> int:
    """Valid prompt ids are ``[0, this)``: ids the tokenizer can decode (added tokens included) that the
    model's embedding also has rows for."""
    model_vocab = model_vocab_size(model["model_dir"])
    return min(int(tokenizer.vocab_size), model_vocab) if model_vocab else int(tokenizer.vocab_size)


def eos_ids_of(tokenizer) -> list[int]:
    """The tokenizer's EOS id as a list (empty when it has none)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else []


# ----------------------------------------------------------------------------- running


@dataclass
class ChoiceState:
    """Output state of one choice (one engine child request)."""

    index: int
    request_id: str
    detok: IncrementalDetokenizer
    stops: StopChecker
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass
class ChoiceDelta:
    """New text for one choice; ``finish_reason`` set on its last delta."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class GenerationRun:
    """One API request's engine work: ``n`` children sharing one output queue.

    Iterate ``deltas()``; call ``close()`` in a ``finally`` (aborts unfinished children, idempotent).
    """

    model: dict
    processed: ProcessedInput
    tokenizer: Any
    stop: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    arrival_time: float
    choices: list[ChoiceState] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_token_time: float | None = None
    finished_time: float | None = None
    reservation: Reservation | None = None
    _closed: bool = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.processed.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def num_cached_tokens(self) -> int:
        return max((c.num_cached_tokens for c in self.choices), default=0)

    async def start(self) -> None:
        """Register the output queue and send every child to the engine (503 when no replica is alive)."""
        by_id = {}
        for i, req in enumerate(self.processed.requests):
            state = ChoiceState(
                index=i, request_id=req.request_id,
                detok=IncrementalDetokenizer(self.tokenizer, self.processed.prompt_token_ids,
                                             skip_special_tokens=self.skip_special_tokens),
                stops=StopChecker(self.stop, self.include_stop_str_in_output))
            self.choices.append(state)
            by_id[req.request_id] = state
        self._by_id = by_id
        try:
            await link().add_requests(self.model["served_model_name"], self.processed.requests, self.queue)
        except EngineUnavailableError as exc:
            raise unavailable(str(exc), 2, "engine_unavailable") from None

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Yield text deltas as engine outputs arrive, until every choice has finished."""
        remaining = len(self.choices)
        while remaining:
            out: EngineCoreOutput = await self.queue.get()
            state = self._by_id.get(out.request_id)
            if state is None or state.finish_reason is not None:
                continue
            first = self.first_token_time is None
            delta = self._apply(state, out)
            if out.new_token_ids and self.reservation is not None \
                    and state.index not in self.reservation.prefill_released:
                try:  # first output token of this child: its prompt tokens leave the prefill backlog
                    await admission().release_prefill(
                        self.reservation, state.index,
                        (self.first_token_time - self.arrival_time) if first and self.first_token_time else None)
                except Exception:  # noqa: BLE001 - release() at close is the backstop
                    log.exception("admission prefill release failed")
            if delta is not None:
                if state.finish_reason is not None:
                    remaining -= 1
                yield delta
        self.finished_time = time.time()

    def _apply(self, state: ChoiceState, out: EngineCoreOutput) -> ChoiceDelta | None:
        if out.num_cached_tokens:
            state.num_cached_tokens = out.num_cached_tokens
        new_ids = list(out.new_token_ids)
        if new_ids and self.first_token_time is None:
            self.first_token_time = time.time()
        state.token_ids.extend(new_ids)
        if out.new_logprobs:
            state.logprobs.extend(out.new_logprobs)
        text = state.detok.push(new_ids) if new_ids else ""
        finish = out.finish_reason
        if finish is not None:
            text += state.detok.flush()
        emit, matched = state.stops.push(text)
        if matched is not None:
            state.finish_reason = FINISH_STOP
            state.stop_reason = matched
            state.text += emit
            if out.finish_reason is None:
                asyncio.get_running_loop().create_task(self._abort([state.request_id]))
            return ChoiceDelta(state.index, emit, new_ids, FINISH_STOP, matched)
        if finish is not None:
            tail, late_match = state.stops.flush()
            emit += tail
            state.finish_reason = FINISH_STOP if late_match is not None else finish
            state.stop_reason = late_match if late_match is not None else out.stop_reason
            state.error = out.error
        state.text += emit
        if not emit and not new_ids and finish is None:
            return None
        return ChoiceDelta(state.index, emit, new_ids, state.finish_reason, state.stop_reason)

    async def _abort(self, request_ids: list[str]) -> None:
        try:
            await link().abort(self.model["served_model_name"], request_ids)
        except Exception:  # noqa: BLE001
            log.exception("abort failed")

    async def close(self) -> None:
        """Abort children that have not finished (client gone, error, cancellation). Idempotent."""
        if self._closed:
            return
        self._closed = True
        unfinished = [c.request_id for c in self.choices if c.finish_reason is None]
        for c in self.choices:
            if c.finish_reason is None:
                c.finish_reason = FINISH_ABORT
        if unfinished:
            await asyncio.shield(self._abort(unfinished))
        for c in self.choices:
            link().release(c.request_id)
        await admission_release(self.reservation)
        if self.finished_time is None:
            self.finished_time = time.time()

    def error_message(self) -> str | None:
        """The first engine error of any choice."""
        for c in self.choices:
            if c.finish_reason == FINISH_ERROR:
                return c.error or "The engine failed while generating"
        return None


async def key_limits_acquire(consumer, ctx, *, prompt_tokens: int, max_tokens: int, n: int):
    """Reserve the request against its key's and tenant's RPM/TPM/concurrency/budget (Redis, atomic, shared by
    every api process) and add the ``x-ratelimit-*`` headers to ``consumer``'s response. The reservation is
    ``prompt_tokens + n × max_tokens``; ``key_limits_settle`` settles it on the real count.

    Raises ``ApiError`` 429 (``rate_limit_error``, with ``Retry-After`` and the ``x-ratelimit-*`` headers) when
    over a limit. 429 is only ever about this key or tenant; platform capacity is 503 (DESIGN.md §3).
    """
    try:
        grant = await limits_acquire(link().redis, settings.LINK_PREFIX, ctx,
                                     max_tokens_reserved=limits_reservation(prompt_tokens, max_tokens, n))
    except RateLimitExceeded as exc:
        raise ApiError(429, exc.message, "rate_limit_error", None, exc.code, list(exc.str_headers)) from None
    consumer.extra_headers.extend(grant_headers(grant))
    return grant


def key_limits_estimate(model: dict, size: int, n: int, max_tokens: int | None, *, exact: bool = False) -> int:
    """Upper bound of the tokens a request can use, known before rendering (what ``key_limits_acquire`` reserves
    for chat, completions and generate before any work): ``prompt + n × completion``, where the prompt is bounded
    as the admission pre-check bounds it (``estimate_prompt_tokens(size, max_model_len, exact=exact)``: body or
    prompt bytes plus overhead, or with ``exact`` a token-id prompt's length) and each completion by
    ``max_tokens`` (``None``: the whole context), the total capped at ``n × max_model_len`` (no child can hold
    more than the context). Settled on the real count when the request ends (``key_limits_settle``)."""
    max_len = int(model["max_model_len"])
    n = max(1, int(n))
    prompt = estimate_prompt_tokens(size, max_len, exact=exact)
    completion = max_len if max_tokens is None else max(0, min(int(max_tokens), max_len))
    return min(limits_reservation(prompt, completion, n), n * max_len)


async def key_limits_acquire_tokens(consumer, ctx, tokens: int):
    """``key_limits_acquire`` of a request that reserves ``tokens`` (its estimate, or 0 for a route that
    generates nothing: ``/tokenize``, ``/detokenize``, the render routes, ``abort_requests``, ``/v1/models``):
    one request against RPM, one concurrency slot, ``tokens`` against TPM and budgets. Raises ``ApiError`` 429."""
    return await key_limits_acquire(consumer, ctx, prompt_tokens=tokens, max_tokens=0, n=1)


@asynccontextmanager
async def key_limits_held(consumer, ctx, tokens: int = 0) -> AsyncIterator[Any]:
    """Hold the key's limits around a route's work: ``key_limits_acquire_tokens`` on entry (429 when over a
    limit, nothing held), settled once on any exit (success, error, client disconnect) on ``tokens`` used."""
    grant = await key_limits_acquire_tokens(consumer, ctx, tokens)
    try:
        yield grant
    finally:
        await key_limits_settle(grant, None, tokens)


async def key_limits_settle(grant, run: "GenerationRun | None", prompt_tokens: int = 0) -> None:
    """Settle a reservation from ``key_limits_acquire`` on the tokens really used (idempotent, never raises)."""
    if grant is None:
        return
    actual = (run.prompt_tokens + run.completion_tokens) if run is not None else prompt_tokens
    try:
        await asyncio.shield(limits_settle(link().redis, settings.LINK_PREFIX, grant, actual_tokens=actual))
    except Exception:  # noqa: BLE001 - the concurrency lease expires by itself if this fails
        log.exception("rate-limit settle failed")


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI ``usage`` object."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def public_finish_reason(reason: str | None) -> str | None:
    """OpenAI exposes only stop/length/tool_calls/content_filter; ``abort`` never reaches a live client."""
    if reason in (FINISH_STOP, FINISH_LENGTH, None):
        return reason
    return FINISH_STOP if reason == FINISH_ABORT else reason


@dataclass
class UsageRecorder:
    """Collects one request's usage and emits it exactly once (``emit`` is idempotent)."""

    endpoint: str
    request_id: str
    arrival_time: float
    ctx: Any = None
    model: str | None = None
    status_code: int = 200
    finish_reason: str | None = None
    run: GenerationRun | None = None
    n: int = 1
    _emitted: bool = False

    async def emit(self) -> None:
        """Send the usage event to the durable Redis stream (one XADD; never a DB write on the loop)."""
        if self._emitted or self.ctx is None:
            return
        self._emitted = True
        run = self.run
        now = time.time()
        event = {
            "request_id": self.request_id,
            "tenant_id": self.ctx.tenant_id,
            "api_key_id": self.ctx.key_id,
            "served_model_name": self.model or "",
            "endpoint": self.endpoint,
            "prompt_tokens": run.prompt_tokens if run else 0,
            "completion_tokens": run.completion_tokens if run else 0,
            "cached_tokens": run.num_cached_tokens if run else 0,
            "status_code": self.status_code,
            "finish_reason": self.finish_reason,
            "ttft_ms": ((run.first_token_time - self.arrival_time) * 1000.0)
            if run and run.first_token_time else None,
            "e2e_latency_ms": ((run.finished_time if run and run.finished_time else now)
                               - self.arrival_time) * 1000.0,
            "n": self.n,
            "created_at": self.arrival_time,
            "finished_at": now,
        }
        try:
            await asyncio.shield(usage_event_emit(link().redis, event))
        except Exception:  # noqa: BLE001 - usage must never break the response
            log.exception("usage event emit failed for %s", self.request_id)


@dataclass
class RequestScope:
    """What one API request holds that must be given back exactly once, whatever its end: the admission
    reservation, the key-limit grant, the engine run (aborted if unfinished) and the usage record."""

    recorder: UsageRecorder
    reservation: Any = None
    grant: Any = None
    run: Any = None


@asynccontextmanager
async def request_scope(endpoint: str, request_id: str, arrival: float, ctx, model_name: str | None,
                        n: int) -> AsyncIterator[RequestScope]:
    """Run one request's work inside; on exit (success, ``ApiError``, client disconnect) abort what is still
    running, release admission, settle key limits and emit the usage event, in that order, once.

    The usage status is 200, the ``ApiError``'s status, or 499 with finish reason ``abort`` when the client
    went away; the finish reason is the first choice's.
    """
    scope = RequestScope(UsageRecorder(endpoint, request_id, arrival, ctx, model_name, n=n))
    try:
        yield scope
        choices = getattr(scope.run, "choices", None)
        if choices and scope.recorder.finish_reason is None:
            scope.recorder.finish_reason = choices[0].finish_reason
    except ApiError as err:
        scope.recorder.status_code = err.status
        raise
    except asyncio.CancelledError:
        scope.recorder.status_code = 499
        scope.recorder.finish_reason = "abort"
        raise
    finally:
        if scope.run is None and scope.reservation is None and scope.grant is None:
            # Refused before holding anything (unknown model, admission 503): only the usage event is left;
            # it must not delay the refusal, which is answered when this returns.
            _background(scope.recorder.emit())
        else:
            if scope.run is not None:
                if hasattr(scope.run, "close"):
                    await scope.run.close()
                scope.recorder.run = scope.run
            await admission_release(scope.reservation)
            await key_limits_settle(scope.grant, scope.run if hasattr(scope.run, "completion_tokens") else None,
                                    getattr(scope.run, "prompt_tokens", 0) or 0)
            await scope.recorder.emit()


_background_tasks: set[asyncio.Task] = set()


def _background(coro) -> None:
    """Run ``coro`` on the loop without awaiting it (a reference is kept until it ends)."""
    task = asyncio.get_running_loop().create_task(coro)
    _background_tasks.add(task)
    task.add_done_callback(_background_tasks.discard)


def to_request_error(exc: RequestValidationError) -> ApiError:
    """Map an input-processing error to HTTP 400."""
    return bad_request(exc.message, exc.param)
