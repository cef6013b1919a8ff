"""Tokens in, tokens out: ``POST /inference/v1/generate`` and ``POST /inference/v1/abort_requests``
(vLLM's tokens-in/tokens-out serving, ``vllm/entrypoints/serve/``).

``/inference/v1/generate`` takes what the render routes return (``gateway.endpoints.render``):
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
import time
from typing import Any

import msgpack
from django.conf import settings

from gateway.http import GatewayConsumer
from gateway.logprobs import generate_logprobs
from gateway.pipeline import inputs, limits, preamble, rendering, responses
from gateway.clients import link, redis
from gateway.pipeline.engine import GenerationRun
from gateway.pipeline.flow import admit_and_start, hold_before_render
from gateway.pipeline.responses import JsonObject
from gateway.pipeline.scope import record_refusal, request_scope
from gateway.pipeline.usage import Usage
from inference.api.input_processor import GenerationDefaults, ProcessedInput, generation_defaults, new_internal_id
from inference.api.output_processor import ChoiceDelta, ChoiceState
from inference.protocol.openai import AbortRequestsRequest, GenerateRequest

ABORT_MAP_TTL_S = 3600


def _abort_key(tenant_id: int, request_id: str) -> str:
    return f"{settings.LINK_PREFIX}:gen:{tenant_id}:{request_id}"


class GenerateConsumer(GatewayConsumer):
    """``POST /inference/v1/generate``."""

    async def handle_request(self, body: bytes) -> None:
        arrival = time.time()
        pre = await preamble.preamble(self, body, GenerateRequest, "generate-tokens-", body_id=lambda r: None,
                                      on_refused=record_refusal("generate"))
        ctx, req = pre.ctx, pre.req
        # the body's id (e.g. the render route's chatcmpl-…) verbatim, cleaned as every echoed id is
        external_id = (req.request_id and preamble.clean_request_id(req.request_id)) or pre.external_id
        self.extra_headers[:] = [h for h in self.extra_headers if h[0] != b"x-request-id"]
        preamble.echo_request_id(self, external_id)
        sp, n = req.sampling_params, req.sampling_params.n or 1
        key, members = _abort_key(ctx.tenant_id, external_id), []
        async with request_scope("generate", new_internal_id(external_id), arrival, ctx, req.model, n,
                                 grant=pre.grant) as scope:
            try:
                model = await preamble.resolve_model(ctx, req.model, generate=True)
                await hold_before_render(self, scope, ctx, model, n=n, size=len(req.token_ids), exact=True,
                                         max_tokens=sp.max_tokens,
                                         constrained=inputs.asks_for_constraint(sp))
                structured = await inputs.structured_constraint(sp, ctx, param_prefix="sampling_params.")
                tokenizer = await rendering.load_tokenizer(model)
                defaults = GenerationDefaults(eos_token_ids=tuple(sp.eos_token_ids) if sp.eos_token_ids is not None
                                              else generation_defaults(model.model_dir).eos_token_ids)
                processed = inputs.process(
                    sp, model, tokenizer, external_id=external_id,
                    prompt_token_ids=list(req.token_ids), prompt_param="token_ids", client_id=link().client_id,
                    arrival_time=arrival, logprobs=sp.logprobs, cache_salt=inputs.cache_salt_for(ctx),
                    defaults=defaults, param_prefix="sampling_params.", structured=structured)
                members = [msgpack.packb([model.served_model_name, r.request_id]) for r in processed.requests]
                await self._map_for_abort(key, processed, members)
                run = await admit_and_start(scope, model, tokenizer, processed, stop=sp.stop or [],
                                            include_stop_str_in_output=bool(sp.include_stop_str_in_output),
                                            skip_special_tokens=sp.skip_special_tokens is not False,
                                            arrival_time=arrival)
                await self._respond(req, run, external_id, int(arrival))
            finally:
                if members:
                    try:
                        await asyncio.shield(redis().srem(key, *members))
                    except Exception:  # noqa: BLE001 - the key expires anyway
                        pass

    @staticmethod
    async def _map_for_abort(key: str, processed: ProcessedInput, members: list[bytes]) -> None:
        """Record the children under the caller's id, so ``abort_requests`` on any api process finds them."""
        await redis().sadd(key, *members)
        await redis().expire(key, ABORT_MAP_TTL_S)

    async def _respond(self, req: GenerateRequest, run: GenerationRun, external_id: str, created: int) -> None:
        want_lp = req.sampling_params.logprobs is not None

        def envelope(choices: list[JsonObject], usage: Usage | None = None) -> JsonObject:
            body: JsonObject = {"request_id": external_id, "model": run.model.served_model_name, "created": created,
                    "choices": choices}
            if usage is not None:
                body["usage"] = usage
            return body

        if not req.stream:
            await responses.complete(run)
            await self.send_json(200, envelope([{
                "index": c.index, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason, "logprobs": generate_logprobs(c.token_ids, c.logprobs) if want_lp else None}
                for c in run.choices], responses.run_usage(run)))
            return
        cursor = responses.LogprobCursor(run)

        def choice_of(d: ChoiceDelta, state: ChoiceState) -> dict[str, Any] | None:
            ids, lps = cursor.take(state)
            if not ids and d.finish_reason is None:
                return None
            return {"index": d.index, "token_ids": ids, "finish_reason": d.finish_reason,
                    "stop_reason": d.stop_reason, "logprobs": generate_logprobs(ids, lps) if want_lp else None}

        await responses.stream(self, run, envelope, choice_of,
                               include_usage=bool(req.stream_options and req.stream_options.include_usage))


class AbortRequestsConsumer(GatewayConsumer):
    """``POST /inference/v1/abort_requests``."""

    async def handle_request(self, body: bytes) -> None:
        ctx = await preamble.authenticate(self)
        async with limits.held(self, ctx):  # one request of the key's RPM and concurrency before parsing
            req = await preamble.parse(body, AbortRequestsRequest)
            r = redis()
            by_model: dict[str, list[str]] = {}
            for rid in req.request_ids:
                for raw in await r.smembers(_abort_key(ctx.tenant_id, rid)):
                    model, internal = msgpack.unpackb(raw)
                    by_model.setdefault(model, []).append(internal)
            for model, ids in by_model.items():  # the request's own handler gets the engine's abort output
                await link().abort_in_engines(model, ids)
            await self.send_json(200, {})
