"""Where rendering runs, and the render-split routes (issue 4; reference/vllm_frontend.md §10.4).

Rendering route (DESIGN.md §4), chosen per api process by ``RENDER_ROUTE`` (Django setting or environment
variable, read at call time):

* ``celery`` (default): the ``inference.*`` tasks on the Celery ``render`` queue; workers may live on
  other machines, a runaway template is bounded by the sandbox budget and by the task's soft/hard time
  limits (the worker child is replaced).
* ``inline``: the same task bodies (``inference.tasks.run_*``) on this process's thread pool via
  ``asyncio.to_thread``. No broker round trip; runaway templates are bounded by the sandbox's operation
  and output budgets only (no process kill). A client-supplied ``chat_template`` (a request's, allowed
  only where the registry allows it; payload flag ``client_chat_template``) is never run here, whatever
  the route: it always goes to the Celery workers, whose time limit kills a render stuck where the
  sandbox's budgets do not reach (issue 14).

Both routes run the very same function on the same payload, so they give the same bytes and token ids
(tests/frontend/test_tokenize_routes.py checks it).

Routes:

* ``POST /v1/chat/completions/render`` takes a chat completion body and returns the tokens-in request
  ``{"request_id", "token_ids", "sampling_params", "model"}`` where ``sampling_params`` is fully resolved
  (model ``generation_config.json`` defaults applied, ``max_tokens`` computed) and ready for
  ``POST /inference/v1/generate``.
* ``POST /v1/completions/render`` takes a completions body and returns a list of such requests, one per
  prompt (vLLM's shape; this server takes one prompt per request, so the list has one element).

Nothing is generated; a render-only deployment (``manage.py serve --no-engine``: api + Celery workers,
no engine) serves them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.conf import settings

from gateway import auth
from gateway.errors import ApiError, bad_request
from gateway.http import GatewayConsumer
from gateway.media import render_chat_media
from inference.input_processor import generation_defaults, process_inputs
from inference.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestValidationError,
    validate_request,
)
from inference import tasks as render_tasks

RENDER_ROUTES = ("celery", "inline")

_INLINE = {
    "inference.render_chat": render_tasks.run_render_chat,
    "inference.tokenize_prompt": render_tasks.run_tokenize_prompt,
    "inference.detokenize": render_tasks.run_detokenize,
}


def render_route() -> str:
    """The rendering route of this process: ``"celery"`` (default) or ``"inline"``.

    Read from the ``RENDER_ROUTE`` Django setting, else the environment. Raises ``ImproperlyConfigured``
    for any other value.
    """
    value = getattr(settings, "RENDER_ROUTE", None) or os.environ.get("RENDER_ROUTE") or "celery"
    value = value.strip().lower()
    if value not in RENDER_ROUTES:
        from django.core.exceptions import ImproperlyConfigured

        raise ImproperlyConfigured(f"RENDER_ROUTE must be one of {RENDER_ROUTES}, got {value!r}")
    return value


def runs_inline(task: str, payload: dict[str, Any]) -> bool:
    """True when ``task`` runs in this process: always with ``RENDER_ROUTE=inline``; otherwise for a small
    template-free task (DESIGN.md §4 allows an in-process pool "for small requests ... where it is measurably
    faster"): tokenizing a prompt of at most ``RENDER_INLINE_MAX_CHARS`` characters (default 4096, about a
    thousand tokens, tens of microseconds of tokenizer time; 0 turns it off). No untrusted code runs in that
    case, so nothing needs the worker's time limits; the broker round trip (two processes to wake, ~6 ms of the
    8 ms of a text ``/tokenize`` on the 2-core box, and the part that grows first when the box is busy with
    image requests) is skipped. Chat templates always go to the workers.

    A payload with ``client_chat_template`` set (the request carried its own ``chat_template``) is never run
    inline, on either route: untrusted template code runs only in a worker process under the task's time
    limits."""
    if is_client_template(task, payload):
        return False
    if render_route() == "inline":
        return True
    limit = getattr(settings, "RENDER_INLINE_MAX_CHARS", None)
    limit = int(limit if limit is not None else os.environ.get("RENDER_INLINE_MAX_CHARS", "4096"))
    prompt = payload.get("prompt")
    return task == "inference.tokenize_prompt" and isinstance(prompt, str) and len(prompt) <= limit


def is_client_template(task: str, payload: dict[str, Any]) -> bool:
    """True when ``payload`` of ``task`` renders a client-supplied chat template (``client_chat_template``,
    set by ``gateway.chat.render_payload`` when the request had a ``chat_template``)."""
    return task == "inference.render_chat" and bool(payload.get("client_chat_template"))


async def call_inline(task: str, payload: dict[str, Any]) -> dict[str, Any]:
    """Run the body of Celery task ``task`` in-process on a worker thread; returns its result dict
    (``{"ok": True, ...}`` or ``{"ok": False, "error": {...}}``, exactly what the task would return).
    Raises ``ValueError`` for a task without an inline body and for a client-supplied chat template
    (those run only on the workers, see ``runs_inline``)."""
    fn = _INLINE.get(task)
    if fn is None:
        raise ValueError(f"no inline route for task {task!r}")
    if is_client_template(task, payload):
        raise ValueError("a client-supplied chat template is never rendered in the api process")
    return await asyncio.get_running_loop().run_in_executor(_inline_pool(), fn, payload)


_INLINE_POOL: ThreadPoolExecutor | None = None


def _inline_pool() -> ThreadPoolExecutor:
    """The threads inline render tasks run on: their own pool, not the loop's default executor, where image
    requests parse multi-megabyte bodies and hash images (a small ``/tokenize`` queued behind those was the
    text path waiting on images). One thread per core; created on first use."""
    global _INLINE_POOL
    if _INLINE_POOL is None:
        _INLINE_POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="inline-render")
    return _INLINE_POOL


def sampling_params_dict(processed, req) -> dict[str, Any]:
    """Fully resolved sampling parameters of ``processed`` (first child; children differ only by seed)
    plus the frontend-applied fields (``n``, ``stop``, ``include_stop_str_in_output``,
    ``skip_special_tokens``): the ``sampling_params`` of a ``GenerateRequest``."""
    params = dataclasses.asdict(processed.requests[0].sampling_params)
    params["logit_bias"] = {str(k): v for k, v in params["logit_bias"].items()}
    params.update(n=req.n or 1, stop=list(req.stop or []),
                  include_stop_str_in_output=bool(req.include_stop_str_in_output),
                  skip_special_tokens=req.skip_special_tokens is not False)
    return params


class _RenderBase(GatewayConsumer):
    async def _prepare(self, body: bytes, schema):
        from gateway.generation import validated_body

        ctx = await auth.authenticate(self.scope["headers"])
        auth.require_scope(ctx, "inference")
        try:
            req = await validated_body(body, functools.partial(validate_request, schema))
        except RequestValidationError as exc:
            raise bad_request(exc.message, exc.param) from None
        return ctx, req

    def _process(self, req, *, external_id, prompt_ids, prompt_param, model, tokenizer, logprobs, cache_salt):
        from gateway.generation import eos_ids_of, vocab_size_of

        try:
            return process_inputs(
                req, external_id=external_id, prompt_token_ids=prompt_ids, prompt_param=prompt_param,
                max_model_len=model["max_model_len"], vocab_size=vocab_size_of(tokenizer, model),
                defaults=generation_defaults(model["model_dir"]), client_id="", arrival_time=time.time(),
                eos_token_ids=eos_ids_of(tokenizer), logprobs=logprobs, cache_salt=cache_salt)
        except RequestValidationError as exc:
            raise bad_request(exc.message, exc.param) from None


class ChatRenderConsumer(_RenderBase):
    """``POST /v1/chat/completions/render`` → ``{"request_id", "token_ids", "sampling_params", "model"}``."""

    async def handle_request(self, body: bytes) -> None:
        from gateway.chat import render_payload
        from gateway.generation import cache_salt_for, client_request_id, key_limits_held, load_tokenizer, \
            resolve_model

        ctx, req = await self._prepare(body, ChatCompletionRequest)
        base_id = client_request_id(self.header(b"x-request-id"), req.request_id)
        self.extra_headers.append((b"x-request-id", base_id.encode()))
        model = await resolve_model(ctx, req.model)
        async with key_limits_held(self, ctx):  # RPM and concurrency before rendering; nothing is generated
            tokenizer = await load_tokenizer(model)
            salt = cache_salt_for(ctx, req.cache_salt)
            rendered = await render_chat_media(model, render_payload(model, req), cache_salt=salt,
                                               tenant_id=ctx.tenant_id)
            processed = self._process(req, external_id="chatcmpl-" + base_id,
                                      prompt_ids=rendered["prompt_token_ids"], prompt_param="messages", model=model,
                                      tokenizer=tokenizer, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                      cache_salt=salt)
            await self.send_json(200, {"request_id": processed.external_id, "token_ids": processed.prompt_token_ids,
                                       "sampling_params": sampling_params_dict(processed, req),
                                       "model": model["served_model_name"], "stream": bool(req.stream)})


class CompletionRenderConsumer(_RenderBase):
    """``POST /v1/completions/render`` → a list with one tokens-in request (one per prompt)."""

    async def handle_request(self, body: bytes) -> None:
        from gateway.completions import prompt_ids_for
        from gateway.generation import cache_salt_for, client_request_id, key_limits_held, load_tokenizer, \
            resolve_model

        ctx, req = await self._prepare(body, CompletionRequest)
        if req.echo:
            raise ApiError(400, "echo cannot be rendered into a tokens-in request", "invalid_request_error", "echo")
        base_id = client_request_id(self.header(b"x-request-id"), req.request_id)
        self.extra_headers.append((b"x-request-id", base_id.encode()))
        model = await resolve_model(ctx, req.model)
        async with key_limits_held(self, ctx):  # RPM and concurrency before tokenizing; nothing is generated
            tokenizer = await load_tokenizer(model)
            prompt_ids, _ = await prompt_ids_for(model, req)
            processed = self._process(req, external_id="cmpl-" + base_id, prompt_ids=prompt_ids,
                                      prompt_param="prompt", model=model, tokenizer=tokenizer, logprobs=req.logprobs,
                                      cache_salt=cache_salt_for(ctx, req.cache_salt))
            await self.send_json(200, [{"request_id": processed.external_id + "-0",
                                        "token_ids": processed.prompt_token_ids,
                                        "sampling_params": sampling_params_dict(processed, req),
                                        "model": model["served_model_name"], "stream": bool(req.stream)}])
