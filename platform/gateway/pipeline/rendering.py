"""Step 7 (docs/ARCHITECTURE.md §2, §4): chat template rendering and tokenizing, on the Celery ``render`` queue or
inline, plus the cheap checks that run before it. Requests and answers are typed (``inference.protocol.render``:
``ChatRenderRequest`` / ``TokenizeRenderRequest`` / ``DetokenizeRenderRequest`` → ``RenderedTokens`` /
``RenderedText`` or a ``RenderFailure``, mapped to its HTTP error by ``failures.api_error_from``).

Rendering route, per api process (``settings.RENDER_ROUTE``):

* ``celery`` (default): the ``inference.*`` tasks on the Celery ``render`` queue; workers may live on other
  machines, a runaway template is bounded by the sandbox budget and by the task's soft/hard time limits (the
  worker child is replaced).
* ``inline``: the same task bodies (``inference.workers.tasks.run_*``) on this process's thread pool. No broker round
  trip; runaway templates are bounded by the sandbox's operation and output budgets only. A client-supplied
  ``chat_template`` (payload flag ``client_chat_template``) is never run here, whatever the route: it always goes
  to the Celery workers, whose time limit kills a render stuck where the sandbox's budgets do not reach.

Both routes run the very same function on the same payload (the request's ``to_wire()``), and read its answer
back the same way (``parse_reply``), so they give the same bytes and token ids.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, cast

from django.conf import settings

from redis.exceptions import RedisError

from config.celery import app as celery_app
from gateway.errors import ErrorCode, bad_request
from gateway.model_cache import ModelSnapshot
from gateway import clients
from gateway.pipeline.failures import api_error_from
from inference.workers import tasks as render_tasks
from inference.api.render_client import RenderReplyWaiter, RenderUnavailableError
from inference.protocol.openai import ChatCompletionRequest, ChatMessage, CompletionRequest, TokenizeChatRequest
from inference.protocol.render import (
    TASK_DETOKENIZE,
    TASK_RENDER_CHAT,
    TASK_TOKENIZE_PROMPT,
    ChatRenderRequest,
    DetokenizeRenderRequest,
    RenderFailure,
    RenderTask,
    ResultT,
    TokenizeRenderRequest,
)
from inference.renderer.tokenizer_cache import LoadedTokenizer, cached_tokenizer, get_tokenizer

# the wire body each render task runs (``inference.workers.tasks``): what the inline route runs in-process
_INLINE: dict[str, Callable[[Any], dict[str, Any]]] = {
    TASK_RENDER_CHAT: render_tasks.run_render_chat,
    TASK_TOKENIZE_PROMPT: render_tasks.run_tokenize_prompt,
    TASK_DETOKENIZE: render_tasks.run_detokenize,
}


def render_route() -> str:
    """This process's rendering route, ``"celery"`` or ``"inline"`` (``settings.RENDER_ROUTE``, validated when
    the settings load)."""
    return str(settings.RENDER_ROUTE)


def is_client_template(request: RenderTask[ResultT]) -> bool:
    """True when ``request`` renders a client-supplied chat template (``client_chat_template``)."""
    return isinstance(request, ChatRenderRequest) and request.client_chat_template


def runs_inline(request: RenderTask[ResultT]) -> bool:
    """True when ``request`` runs in this process: always with ``RENDER_ROUTE=inline``; otherwise for a small
    template-free task (docs/ARCHITECTURE.md §4; DECISIONS D-016: an in-process pool where it is measurably faster):
    tokenizing a prompt of at most ``RENDER_INLINE_MAX_CHARS`` characters (default 4096; 0 turns it
    off): no untrusted code runs, and the broker round trip (~6 ms of the 8 ms of a text ``/tokenize``) is
    skipped. Chat templates go to the workers; a client-supplied one is never run inline, on either route."""
    if is_client_template(request):
        return False
    if render_route() == "inline":
        return True
    return (isinstance(request, TokenizeRenderRequest) and isinstance(request.prompt, str)
            and len(request.prompt) <= settings.RENDER_INLINE_MAX_CHARS)


_INLINE_POOL: ThreadPoolExecutor | None = None


def _inline_pool() -> ThreadPoolExecutor:
    """The threads inline render tasks run on: their own pool, not the loop's default executor, where image
    requests parse multi-megabyte bodies and hash images. One thread per core; created on first use."""
    global _INLINE_POOL
    if _INLINE_POOL is None:
        _INLINE_POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="inline-render")
    return _INLINE_POOL


async def call_inline(request: RenderTask[ResultT]) -> ResultT | RenderFailure:
    """Run the body of ``request``'s Celery task in-process on a worker thread, on the same wire payload a worker
    gets; returns exactly what the task would answer (its result or a ``RenderFailure``). Raises ``ValueError`` for a
    task without an inline body and for a client-supplied chat template."""
    fn = _INLINE.get(request.task)
    if fn is None:
        raise ValueError(f"no inline route for task {request.task!r}")
    if is_client_template(request):
        raise ValueError("a client-supplied chat template is never rendered in the api process")
    reply = await asyncio.get_running_loop().run_in_executor(_inline_pool(), fn, request.to_wire())
    return request.parse_reply(reply)


async def call_render(request: RenderTask[ResultT]) -> ResultT:
    """Run a render task (inline or on the ``render`` queue, ``runs_inline``) and return its result.

    A worker's ``RenderFailure`` becomes its HTTP error (``failures.api_error_from``: 400 with the renderer's
    ``param`` and code; 503 for a worker that ran out of time outside the template; 500 for a renderer defect); no
    answer within ``RENDER_WAIT_TIMEOUT_S`` while a render worker is alive, or no render worker back within
    ``RENDER_WORKER_RETURN_S`` (``inference.api.render_liveness.remaining_wait``), becomes 503.
    """
    if runs_inline(request):
        reply = await call_inline(request)
        if not isinstance(reply, RenderFailure) and reply.segment_cache:
            _count_inline(reply.segment_cache)
    else:
        waiter = RenderReplyWaiter.for_current_loop(settings.REDIS_URL, settings.LINK_PREFIX)
        try:
            reply = await waiter.request(celery_app, request, timeout=settings.RENDER_WAIT_TIMEOUT_S,
                                         worker_return=settings.RENDER_WORKER_RETURN_S)
        except RenderUnavailableError as exc:
            raise api_error_from(exc) from None
    if isinstance(reply, RenderFailure):
        raise api_error_from(reply) from None
    return reply


def _count_inline(stats: dict[str, int]) -> None:
    """Add an inline task's segment-cache tallies to the shared Redis counters (``inference.workers.tasks.
    count_segment_cache``; the workers count theirs in their reply) in the background: a metric never delays or
    fails the request."""
    async def count() -> None:
        try:
            pipe = clients.redis().pipeline(transaction=False)
            render_tasks.count_segment_cache(pipe, settings.LINK_PREFIX, stats)
            await pipe.execute()
        except (RedisError, OSError):
            pass
    clients.background(count(), "count segment-cache tallies")


async def load_tokenizer(model: ModelSnapshot) -> LoadedTokenizer:
    """The model's tokenizer, loaded once per process off the event loop (once loaded, found in the cache on the
    loop: two ``stat`` calls, no thread hop)."""
    hit = cached_tokenizer(model.tokenizer_dir)
    return hit if hit is not None else await asyncio.to_thread(get_tokenizer, model.tokenizer_dir)


def check_prompt_chars(model: ModelSnapshot, tokenizer: LoadedTokenizer, n_chars: int, param: str, *,
                       truncating: bool = False) -> None:
    """Refuse, before rendering or tokenizing, text that cannot fit the context whatever its tokenization:
    more than ``max_model_len × (longest token string in the vocabulary)`` characters (vLLM's character
    pre-check, ``vllm/entrypoints/renderer.py``). Keeps a huge prompt from holding a render worker.
    Raises ``ApiError`` 400 ``context_length_exceeded`` with both numbers; ``truncating`` (the request asked for
    ``truncate_prompt_tokens``) says that truncation does not lift this bound."""
    bound = int(model.max_model_len) * max(1, int(getattr(tokenizer, "max_token_chars", 0) or 0))
    if bound and n_chars > bound:
        advice = ("'truncate_prompt_tokens' applies to inputs within that bound only; shorten the input"
                  if truncating else "Please reduce the length of the input")
        raise bad_request(
            f"The input has {n_chars} characters, more than can fit this model's maximum context length of "
            f"{model.max_model_len} tokens (at most {bound} characters). {advice}.", param,
            ErrorCode.CONTEXT_LENGTH_EXCEEDED)


def message_chars(messages: list[ChatMessage]) -> int:
    """Characters of text in chat ``messages`` (string contents and text parts)."""
    total = 0
    for m in messages:
        content = m.content
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return total


def chat_template_for(model: ModelSnapshot, req: ChatCompletionRequest | TokenizeChatRequest) -> str | None:
    """The template to render with: request template (only if the registry allows it), else the registry
    override, else ``None`` (the tokenizer's own)."""
    if req.chat_template is not None:
        if not model.allow_request_chat_template:
            raise bad_request("Client-supplied chat templates are not allowed for this model", "chat_template",
                              ErrorCode.CHAT_TEMPLATE_NOT_ALLOWED)
        return req.chat_template
    return model.chat_template or None


def chat_render_payload(model: ModelSnapshot, req: ChatCompletionRequest | TokenizeChatRequest) -> ChatRenderRequest:
    """The ``inference.render_chat`` request of a chat request (``ChatCompletionRequest`` or a chat ``/tokenize``
    body) on ``model``: the same request on every route that renders a chat (its ``cache_salt`` is set by
    ``media.render_chat_media``)."""
    add_generation_prompt = bool(req.add_generation_prompt)
    if req.continue_final_message:
        add_generation_prompt = False
    return ChatRenderRequest(
        tokenizer_dir=model.tokenizer_dir,
        messages=[m.model_dump(exclude_unset=True) for m in req.messages],
        add_generation_prompt=add_generation_prompt,
        continue_final_message=bool(req.continue_final_message),
        tools=[t.model_dump(exclude_unset=True) for t in req.tools] if req.tools else None,
        documents=req.documents,
        chat_template=chat_template_for(model, req),
        client_chat_template=req.chat_template is not None,  # never rendered inline (runs_inline)
        chat_template_kwargs=req.chat_template_kwargs or None,
        add_special_tokens=bool(req.add_special_tokens),
        # control-token strings in request text stay text unless the operator opted this model out
        allow_control_tokens=bool(model.allow_control_tokens_in_content),
        max_model_len=int(model.max_model_len),  # the worker's character backstop (inference.workers.tasks)
        return_prompt_text=False,  # the api uses only the ids: the rendered text would double the reply
    )


async def tokenize_prompt(model: ModelSnapshot, prompt: str, add_special_tokens: bool, cache_salt: str) -> list[int]:
    """Token ids of a completion-style text ``prompt``; ``cache_salt`` (``inputs.cache_salt_for``) scopes the segment
    cache's keys."""
    result = await call_render(TokenizeRenderRequest(model.tokenizer_dir, prompt, add_special_tokens,
                                                     int(model.max_model_len), cache_salt))
    return result.prompt_token_ids


# text prompts of one batch tokenized at once: a batch of many prompts enters the FCFS render queue a few
# tasks at a time, so other requests' renders are not queued behind all of them
BATCH_TOKENIZE_CONCURRENCY = 8


async def prompt_ids_for(model: ModelSnapshot, req: CompletionRequest,
                         cache_salt: str) -> list[tuple[list[int], str | None]]:
    """``(prompt_token_ids, prompt_text)`` of each prompt of a ``CompletionRequest`` (one for a single prompt), in
    order: token-id prompts pass through (text ``None``); text is tokenized (BOS per ``add_special_tokens``,
    default true), at most ``BATCH_TOKENIZE_CONCURRENCY`` prompts at a time. Raises what ``call_render`` raises
    (the first failing prompt's error)."""
    add_special = req.add_special_tokens is not False
    prompts = req.prompts
    if all(isinstance(p, list) for p in prompts):
        return [(list(cast(list[int], p)), None) for p in prompts]
    gate = asyncio.Semaphore(BATCH_TOKENIZE_CONCURRENCY)

    async def one(text: str) -> tuple[list[int], str | None]:
        async with gate:
            return await tokenize_prompt(model, text, add_special, cache_salt), text

    if len(prompts) == 1:
        return [await one(cast(str, prompts[0]))]
    tasks = [asyncio.ensure_future(one(cast(str, p))) for p in prompts]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:  # the first failure (or the client gone) ends the request: the rest are not waited for
            t.cancel()
        raise


async def detokenize(model: ModelSnapshot, tokens: list[int], skip_special_tokens: bool) -> str:
    """Text of ``tokens`` (``/detokenize``)."""
    result = await call_render(DetokenizeRenderRequest(model.tokenizer_dir, tokens, skip_special_tokens))
    return result.text
