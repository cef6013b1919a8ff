"""The render-split routes (vLLM's ``/v1/chat/completions/render`` and ``/v1/completions/render``):

* ``POST /v1/chat/completions/render`` takes a chat completion body and returns the tokens-in request
  ``{"request_id", "token_ids", "sampling_params", "model"}`` where ``sampling_params`` is fully resolved
  (model ``generation_config.json`` defaults applied, ``max_tokens`` computed) and ready for
  ``POST /inference/v1/generate``.
* ``POST /v1/completions/render`` takes a completions body and returns a list of such requests, one per
  prompt (vLLM's shape), ``request_id`` ``<id>-<prompt index>``.

Nothing is generated; a render-only deployment (``manage.py serve --no-engine``: api + Celery workers,
no engine) serves them. Where rendering runs: ``gateway.pipeline.rendering``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from gateway.errors import bad_request
from gateway.http import GatewayConsumer
from gateway.pipeline import flow, inputs, limits, preamble, rendering
from gateway.model_cache import ModelSnapshot
from inference.api.input_processor import ProcessedInput, generation_defaults
from inference.protocol.openai import ChatCompletionRequest, CompletionRequest


def sampling_params_dict(processed: ProcessedInput, req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """Fully resolved sampling parameters of ``processed`` (first child; children differ only by seed)
    plus the frontend-applied fields (``n``, ``stop``, ``include_stop_str_in_output``,
    ``skip_special_tokens``): the ``sampling_params`` of a ``GenerateRequest``."""
    params = dataclasses.asdict(processed.requests[0].sampling_params)
    params["logit_bias"] = {str(k): v for k, v in params["logit_bias"].items()}
    # the engine's flattened constraint in vLLM's shape (``SamplingParams.structured_outputs``)
    kind, spec = params.pop("structured_kind"), params.pop("structured_spec")
    params.pop("structured_after_token_ids")
    if kind is not None:
        params["structured_outputs"] = structured_outputs_dict(kind, spec)
    params.update(n=req.n or 1, stop=list(req.stop or []),
                  include_stop_str_in_output=bool(req.include_stop_str_in_output),
                  skip_special_tokens=req.skip_special_tokens is not False)
    return params


def structured_outputs_dict(kind: str, spec: str) -> dict[str, Any]:
    """vLLM's ``structured_outputs`` for the engine's ``(structured_kind, structured_spec)``: what
    ``/inference/v1/generate`` takes back."""
    if kind == "json_object":
        return {"json_object": True}
    if kind == "choice":
        return {"choice": json.loads(spec)}
    return {kind: spec}


def _tokens_in_request(processed: ProcessedInput, req: ChatCompletionRequest | CompletionRequest,
                       model: ModelSnapshot, request_id: str) -> dict[str, Any]:
    return {"request_id": request_id, "token_ids": processed.prompt_token_ids,
            "sampling_params": sampling_params_dict(processed, req), "model": model.served_model_name,
            "stream": bool(req.stream)}


class ChatRenderConsumer(GatewayConsumer):
    """``POST /v1/chat/completions/render`` → ``{"request_id", "token_ids", "sampling_params", "model"}``."""

    async def handle_request(self, body: bytes) -> None:
        pre = await preamble.preamble(self, body, ChatCompletionRequest, "chatcmpl-")
        ctx, req = pre.ctx, pre.req
        async with limits.held(self, ctx, grant=pre.grant):  # RPM and concurrency taken before parsing
            model = await preamble.resolve_model(ctx, req.model, generate=True)
            _, _, processed = await flow.render_chat_input(ctx, model, req, external_id=pre.external_id,
                                                             client_id="", arrival_time=time.time())
            await self.send_json(200, _tokens_in_request(processed, req, model, processed.external_id))


class CompletionRenderConsumer(GatewayConsumer):
    """``POST /v1/completions/render`` → a list of tokens-in requests, one per prompt."""

    async def handle_request(self, body: bytes) -> None:
        ctx = await preamble.authenticate(self)
        async with limits.held(self, ctx):  # RPM and concurrency before parsing; nothing is generated
            req = await preamble.parse(body, CompletionRequest)
            if req.echo:
                raise bad_request("echo cannot be rendered into a tokens-in request", "echo")
            base_id = preamble.client_request_id(self.header(b"x-request-id"), req.request_id)
            preamble.echo_request_id(self, base_id)
            model = await preamble.resolve_model(ctx, req.model, generate=True)
            tokenizer = await rendering.load_tokenizer(model)
            rendering.check_prompt_chars(model, tokenizer, max(len(p) if isinstance(p, str) else 0
                                                               for p in req.prompts), "prompt")
            structured = await inputs.structured_constraint(req, ctx)
            out = []
            salt, defaults = inputs.cache_salt_for(ctx, req.cache_salt), generation_defaults(model.model_dir)
            for i, (prompt_ids, _) in enumerate(await rendering.prompt_ids_for(model, req, salt)):
                processed = inputs.process(
                    req, model, tokenizer, external_id="cmpl-" + base_id, prompt_token_ids=prompt_ids,
                    prompt_param="prompt", client_id="", arrival_time=time.time(), logprobs=req.logprobs,
                    cache_salt=salt, defaults=defaults, structured=structured)
                out.append(_tokens_in_request(processed, req, model, f"{processed.external_id}-{i}"))
            await self.send_json(200, out)
