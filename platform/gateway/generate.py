"""Tokens in, tokens out: ``POST /inference/v1/generate`` and ``POST /inference/v1/abort_requests``
(reference/vllm_frontend.md §10.4, issue 4).

``/inference/v1/generate`` takes what the render routes return (``gateway.render``):
``{"request_id"?, "token_ids": [int, ...], "sampling_params": {...}, "model", "stream"?, "stream_options"?}``.
The same checks as chat/completions run before any byte is sent (ids in the vocabulary, prompt length vs
``max_model_len``, ``max_tokens`` vs the room left, sampling ranges); ``max_tokens`` omitted → the room
left. Admission counts it like chat (exact ``n × len(token_ids)``; 503 + ``Retry-After`` when full).
``n`` children get seeds ``seed + i``; stop strings are applied (the output ids then end with the
token that completed the stop string).

Non-streaming response::

    {"request_id", "model", "created", "choices": [{"index", "token_ids", "finish_reason",
     "stop_reason", "logprobs"}], "usage": {...}}

``logprobs`` (only when ``sampling_params.logprobs`` is set) is ``{"content": [{"token_id", "logprob",
"top_logprobs": [{"token_id", "logprob"}, ...]}, ...]}``. Streaming: ``data:`` events with the same envelope
whose choices carry the new ``token_ids`` of one index, the last one of each index its ``finish_reason``;
a usage event (``choices: []``) with ``stream_options.include_usage``; then ``data: [DONE]``.

Request ids: the body ``request_id`` (e.g. the ``chatcmpl-…`` id the render route returned), else
``generate-tokens-<X-Request-Id or random>``. ``/inference/v1/abort_requests`` ``{"request_ids": [...]}``
aborts every in-flight generate request of the caller's tenant with one of those ids, whichever api
process runs it (the id → engine-request mapping lives in Redis under ``{LINK_PREFIX}:gen:``); 200 ``{}``
even for ids that are unknown or already finished, as vLLM does.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time

import msgpack
from django.conf import settings

from gateway import auth
from gateway.errors import ApiError, bad_request
from gateway.generation import (
    GenerationRun,
    admission_precheck,
    admission_reserve,
    cache_salt_for,
    key_limits_acquire_tokens,
    key_limits_estimate,
    key_limits_held,
    client_request_id,
    validated_body,
    eos_ids_of,
    link,
    load_tokenizer,
    request_scope,
    resolve_model,
    usage_dict,
    vocab_size_of,
)
from gateway.http import GatewayConsumer, json_body
from inference.input_processor import GenerationDefaults, generation_defaults, new_internal_id, process_inputs
from inference.protocol.engine import control_stream
from inference.protocol.openai import (
    AbortRequestsRequest,
    GenerateRequest,
    RequestValidationError,
    validate_request,
)

ABORT_MAP_TTL_S = 3600


def _abort_key(tenant_id, request_id: str) -> str:
    return f"{settings.LINK_PREFIX}:gen:{tenant_id}:{request_id}"


class _ParamsView:
    """``GenerateSamplingParams`` seen through the attribute names ``process_inputs`` reads."""

    def __init__(self, sp):
        self._sp = sp
        self.model_fields_set = {"max_tokens"} if sp.max_tokens is not None else set()

    def __getattr__(self, name):
        return getattr(self._sp, name)

    @property
    def requested_max_tokens(self):
        return self._sp.max_tokens, "max_tokens"


def _logprobs(entries, token_ids) -> dict:
    def fin(v):
        return -9999.0 if v is None or not math.isfinite(v) else max(float(v), -9999.0)

    content = []
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            continue
        content.append({"token_id": tid, "logprob": fin(entry[0]),
                        "top_logprobs": [{"token_id": int(i), "logprob": fin(lp)} for i, lp in (entry[1] or [])]})
    return {"content": content}


class GenerateConsumer(GatewayConsumer):
    """``POST /inference/v1/generate``."""

    async def handle_request(self, body: bytes) -> None:
        arrival = time.time()
        ctx = await auth.authenticate(self.scope["headers"])
        auth.require_scope(ctx, "inference")
        try:
            req = await validated_body(body, functools.partial(validate_request, GenerateRequest))
        except RequestValidationError as exc:
            raise bad_request(exc.message, exc.param) from None
        external_id = req.request_id or "generate-tokens-" + client_request_id(self.header(b"x-request-id"), None)
        self.extra_headers.append((b"x-request-id", external_id.encode()))
        sp = req.sampling_params
        members: list[bytes] = []
        key = _abort_key(ctx.tenant_id, external_id)
        async with request_scope("generate", new_internal_id(external_id), arrival, ctx, req.model,
                                 sp.n or 1) as scope:
            try:
                model = await resolve_model(ctx, req.model)
                scope.grant = await key_limits_acquire_tokens(self, ctx, key_limits_estimate(
                    model, len(req.token_ids), sp.n or 1, sp.max_tokens, exact=True))
                scope.reservation = await admission_precheck(model, scope.recorder.request_id, sp.n or 1,
                                                             len(req.token_ids), exact=True)
                tokenizer = await load_tokenizer(model)
                defaults = generation_defaults(model["model_dir"])
                defaults = GenerationDefaults(eos_token_ids=tuple(sp.eos_token_ids)
                                              if sp.eos_token_ids is not None else defaults.eos_token_ids)
                try:
                    processed = process_inputs(
                        _ParamsView(sp), external_id=external_id, prompt_token_ids=list(req.token_ids),
                        prompt_param="token_ids", max_model_len=model["max_model_len"],
                        vocab_size=vocab_size_of(tokenizer, model), defaults=defaults, client_id=link().client_id,
                        arrival_time=arrival, eos_token_ids=eos_ids_of(tokenizer), logprobs=sp.logprobs,
                        cache_salt=cache_salt_for(ctx))
                except RequestValidationError as exc:
                    param = exc.param if exc.param in (None, "token_ids") else f"sampling_params.{exc.param}"
                    raise bad_request(exc.message, param) from None
                await admission_reserve(scope.reservation, processed)
                run = scope.run = GenerationRun(
                    model=model, processed=processed, tokenizer=tokenizer, stop=sp.stop or [],
                    include_stop_str_in_output=bool(sp.include_stop_str_in_output),
                    skip_special_tokens=sp.skip_special_tokens is not False, arrival_time=arrival,
                    reservation=scope.reservation)
                members = [msgpack.packb([model["served_model_name"], r.request_id]) for r in processed.requests]
                r = link().redis
                await r.sadd(key, *members)
                await r.expire(key, ABORT_MAP_TTL_S)
                await run.start()
                if req.stream:
                    await self._stream(req, run, external_id, int(arrival))
                else:
                    await self._complete(req, run, external_id, int(arrival))
            finally:
                if members:
                    try:
                        await asyncio.shield(link().redis.srem(key, *members))
                    except Exception:  # noqa: BLE001 - the key expires anyway
                        pass

    def _envelope(self, run, external_id, created, choices, usage=None) -> dict:
        body = {"request_id": external_id, "model": run.model["served_model_name"], "created": created,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    async def _complete(self, req, run: GenerationRun, external_id, created) -> None:
        async for _ in run.deltas():
            pass
        error = run.error_message()
        if error:
            raise ApiError(503, error, "server_error", None, "engine_error", [("retry-after", "1")])
        want_lp = req.sampling_params.logprobs is not None
        choices = [{"index": c.index, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "logprobs": _logprobs(c.logprobs, c.token_ids) if want_lp else None} for c in run.choices]
        await self.send_json(200, self._envelope(run, external_id, created, choices,
                                                 usage_dict(run.prompt_tokens, run.completion_tokens,
                                                            run.num_cached_tokens)))

    async def _stream(self, req, run: GenerationRun, external_id, created) -> None:
        want_lp = req.sampling_params.logprobs is not None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        await self.start_sse()
        seen = {c.index: 0 for c in run.choices}
        async for d in run.deltas():
            state = run.choices[d.index]
            if state.finish_reason == "error":
                break
            start, seen[d.index] = seen[d.index], len(state.token_ids)
            ids = state.token_ids[start:]
            if not ids and d.finish_reason is None:
                continue
            await self.send_event(self._envelope(run, external_id, created, [{
                "index": d.index, "token_ids": ids, "finish_reason": d.finish_reason, "stop_reason": d.stop_reason,
                "logprobs": _logprobs(state.logprobs[start:], ids) if want_lp else None}]))
        error = run.error_message()
        if error:
            raise ApiError(503, error, "server_error", None, "engine_error")
        if include_usage:
            await self.send_event(self._envelope(run, external_id, created, [], usage_dict(
                run.prompt_tokens, run.completion_tokens, run.num_cached_tokens)))
        await self.end_sse()


class AbortRequestsConsumer(GatewayConsumer):
    """``POST /inference/v1/abort_requests``."""

    async def handle_request(self, body: bytes) -> None:
        ctx = await auth.authenticate(self.scope["headers"])
        auth.require_scope(ctx, "inference")
        try:
            req = validate_request(AbortRequestsRequest, await json_body(body))
        except RequestValidationError as exc:
            raise bad_request(exc.message, exc.param) from None
        async with key_limits_held(self, ctx):  # one request of the key's RPM and concurrency, no tokens
            r = link().redis
            by_model: dict[str, list[str]] = {}
            for rid in req.request_ids:
                for raw in await r.smembers(_abort_key(ctx.tenant_id, rid)):
                    model, internal = msgpack.unpackb(raw)
                    by_model.setdefault(model, []).append(internal)
            for model, ids in by_model.items():
                await r.xadd(control_stream(settings.LINK_PREFIX, model), {"a": msgpack.packb(ids)},
                             maxlen=10000, approximate=True)
            await self.send_json(200, {})
