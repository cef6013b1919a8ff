"""Celery tasks of queue ``render``: thin wrappers over ``inference.renderer`` (docs/ARCHITECTURE.md §4).

Django-free: they use ``celery.shared_task``; the app (``platform/config/celery.py``) routes
``inference.render_chat``, ``inference.tokenize_prompt`` and ``inference.detokenize`` to queue
``render``. Each task takes one request of ``inference.protocol.render`` on the wire (``ChatRenderRequest``,
``TokenizeRenderRequest``, ``DetokenizeRenderRequest``) and answers its result or a ``RenderFailure``, on the wire,
never an exception:

* success: ``{"ok": True, ...}`` (``RenderedTokens``, ``RenderedText``)
* failure: ``{"ok": False, "error": {"type": <error class name>, "message": str, "param": str|None, "code": str}}``;
  ``type`` is a ``RenderError`` subclass name (a client error), ``"TemplateTimeoutError"`` or
  ``"RenderOverloadedError"`` when the soft time limit fired, or ``"InternalError"`` for an unexpected bug;
  ``code`` the public error code of the type (``inference.protocol.render.failure_code``), which the api maps to
  its HTTP status (``gateway.pipeline.failures``).

Time limits: ``soft_time_limit`` = ``RENDER_TIME_LIMIT_S`` (default 5 s) raises
``SoftTimeLimitExceeded`` inside the task (-> ``TemplateTimeoutError``); the hard ``time_limit``
(soft + ``RENDER_HARD_TIME_LIMIT_EXTRA_S``, default 2 s) kills a prefork child stuck in C code or
ignoring the soft signal, and Celery replaces it. A ``solo`` worker (``serve``'s default) runs tasks in
its main process, where Celery enforces neither: ``inference.workers.render_limits`` gives it the same two limits
(the hard one exits the worker) and refuses a task handed back twice. The sandbox's operation budget
normally stops runaway templates well before either limit.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any, Callable, TypeVar

import json

import orjson
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from celery import shared_task
from celery.concurrency import get_implementation
from celery.concurrency.solo import TaskPool as SoloPool
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import worker_init

from inference.workers import render_limits

from inference.shared.config import SETTINGS
from inference.protocol.render import (
    ChatRenderRequest,
    DetokenizeRenderRequest,
    PayloadError,
    RenderedText,
    RenderedTokens,
    RenderFailure,
    RenderResult,
    TokenizeRenderRequest,
    Wire,
)
from inference.renderer.chat_template import (
    detokenize,
    render_chat,
    reset_template_seconds,
    template_seconds,
    tokenize_prompt,
)
from inference.renderer.errors import ContextLengthError, RenderError, RenderOverloadedError, TemplateTimeoutError
from inference.renderer import segment_cache
from inference.renderer.segment_cache import STATS as SEGMENT_STATS
from inference.renderer.tokenizer_cache import get_tokenizer

logger = logging.getLogger(__name__)

RENDER_TIME_LIMIT_S = SETTINGS.render_time_limit_s
RENDER_HARD_TIME_LIMIT_S = RENDER_TIME_LIMIT_S + SETTINGS.render_hard_time_limit_extra_s


@worker_init.connect
def _own_time_limits(sender: Any = None, **_kwargs: Any) -> None:
    """A worker whose pool is ``solo`` runs tasks in its main process, where Celery enforces no time limit: arm
    ``render_limits`` with the render queue's limits there (before the pool starts)."""
    pool = getattr(sender, "pool_cls", None)
    try:
        cls = get_implementation(pool) if pool is not None else None
    except (ImportError, KeyError, AttributeError):
        return
    if isinstance(cls, type) and issubclass(cls, SoloPool):
        render_limits.enable(RENDER_TIME_LIMIT_S, RENDER_HARD_TIME_LIMIT_S)


# the shared segment tier's reads are an optimisation: they wait this long at most, and are never retried
SEGMENT_TIER_SOCKET_TIMEOUT_S = 0.25
_segment_tier_client: redis.Redis | None = None


def _segment_tier_redis() -> redis.Redis:
    """This worker's Redis client for the shared segment tier: ``SEGMENT_CACHE_REDIS_URL``, else the reply client's
    Redis, with ``SEGMENT_TIER_SOCKET_TIMEOUT_S`` socket and connect timeouts and no retries (redis-py's default
    retries a failed connection ten times with back-off, seconds of a render's time limit); made on first use."""
    global _segment_tier_client
    if _segment_tier_client is None:
        from celery import current_app

        _segment_tier_client = redis.Redis.from_url(
            SETTINGS.segment_cache_redis_url or SETTINGS.redis_url or current_app.conf.result_backend,
            socket_timeout=SEGMENT_TIER_SOCKET_TIMEOUT_S,
            socket_connect_timeout=SEGMENT_TIER_SOCKET_TIMEOUT_S, retry=Retry(NoBackoff(), 0))
    return _segment_tier_client


@worker_init.connect
def _shared_segment_tier(sender: Any = None, **_kwargs: Any) -> None:
    """Render workers share long chat-prompt segments' ids in Redis (``segment_cache.SharedTier``, read with
    ``_segment_tier_redis``, written in the reply pipeline); ``SEGMENT_CACHE_REDIS_MIN_CHARS`` 0 leaves it off, and so
    does a ``SEGMENT_CACHE_REDIS_URL`` that is not a Redis URL (logged). The client itself is made on first use, in
    the process that runs the tasks."""
    url = SETTINGS.segment_cache_redis_url
    if url:
        try:
            redis.Redis.from_url(url).close()  # parses the URL; connects to nothing
        except ValueError as exc:
            logger.error("SEGMENT_CACHE_REDIS_URL is not a Redis URL (%s): the shared segment tier is off", exc)
            segment_cache.disable_shared_tier()
            return
    segment_cache.enable_shared_tier(_segment_tier_redis)


def failure_of(exc: BaseException) -> RenderFailure:
    """The ``RenderFailure`` a task answers for ``exc``: a ``RenderError`` as its class, a malformed payload as a
    ``RenderError`` naming the field, the soft time limit as ``TemplateTimeoutError`` (the template took the time)
    or ``RenderOverloadedError`` (it went elsewhere), anything else as ``InternalError`` (logged)."""
    if isinstance(exc, RenderError):
        return RenderFailure.of(type(exc).__name__, exc.message, exc.param)
    if isinstance(exc, PayloadError):
        return RenderFailure.of("RenderError", exc.message, exc.param)
    if isinstance(exc, SoftTimeLimitExceeded):
        # The limit is for the client's template; if most of the time went elsewhere (a cold worker loading the
        # tokenizer, a CPU-starved machine), the request was fine and the server was slow: 503, not 400.
        err: RenderError
        if template_seconds() >= RENDER_TIME_LIMIT_S / 2:
            err = TemplateTimeoutError(f"rendering took longer than {RENDER_TIME_LIMIT_S:g} s and was abandoned")
        else:
            err = RenderOverloadedError(
                f"the render worker could not finish within {RENDER_TIME_LIMIT_S:g} s "
                f"({template_seconds():.1f} s of it in the chat template): it is overloaded or was starting")
        return failure_of(err)
    logger.exception("render task failed unexpectedly")
    return RenderFailure.of("InternalError", f"{type(exc).__name__}: {exc}")


def _error(exc: BaseException) -> Wire:
    return failure_of(exc).to_wire()


_Request = TypeVar("_Request", ChatRenderRequest, TokenizeRenderRequest, DetokenizeRenderRequest)


def _structured(read: Callable[[object], _Request]) -> Callable[
        [Callable[[_Request], RenderResult]], Callable[[Any], Wire]]:
    """A typed task body (request → result) as the task's wire body (argument → reply), which never raises: the
    template clock and the segment-cache tallies reset first, the argument read as a request (``read``: its
    ``from_wire``), the segment cache keyed with its ``cache_salt`` (``segment_cache.salt_scope``; none: unscoped),
    then the body's result on the wire (with its ``segment_cache`` tallies when the segment cache was used), or any
    failure (Ctrl-C and exit aside) as the ``RenderFailure`` of ``failure_of``."""

    def wrap(body: Callable[[_Request], RenderResult]) -> Callable[[Any], Wire]:
        @functools.wraps(body)
        def run(payload: Any) -> Wire:
            reset_template_seconds()
            SEGMENT_STATS.reset()
            try:
                request = read(payload)
                # segments are cached per cache scope (the tenant's, as the engines' prefix caches are)
                salt = request.cache_salt
                segment_cache.salt_scope(salt if isinstance(salt, str) else None)
                result = body(request)
                stats = SEGMENT_STATS.snapshot()
                if stats["hits"] or stats["misses"]:
                    result.segment_cache = stats  # added to the shared counters by the caller (count_segment_cache)
                return result.to_wire()
            except BaseException as exc:
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                return _error(exc)
            finally:
                segment_cache.salt_scope(None)  # nothing of this request's scope stays on the thread

        return run

    return wrap


def prompt_char_bound(tokenizer_dir: str, max_model_len: int) -> int:
    """The most characters of text that can fit ``max_model_len`` tokens whatever their tokenization:
    ``max_model_len × max_token_chars`` (the tokenizer's longest token string; vLLM's character pre-check,
    ``vllm/entrypoints/renderer.py``). 0 when ``max_model_len`` is not positive (no bound)."""
    if int(max_model_len) <= 0:
        return 0
    return int(max_model_len) * max(1, int(get_tokenizer(tokenizer_dir).max_token_chars))


def text_chars(messages: Any) -> int:
    """Characters of text in chat ``messages`` as dicts (string contents and the ``text`` of parts)."""
    total = 0
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict)
                         and isinstance(p.get("text"), str))
    return total


def check_chars(request: ChatRenderRequest | TokenizeRenderRequest, n_chars: int, param: str) -> None:
    """The render worker's backstop of the gateway's character pre-check: with ``request.max_model_len`` set,
    raise ``ContextLengthError`` (param ``param``) before tokenizing ``n_chars`` characters of text that cannot fit
    the context, so no prompt of any size makes the worker allocate far beyond its own size."""
    max_len = request.max_model_len
    if not max_len:
        return
    bound = prompt_char_bound(request.tokenizer_dir, int(max_len))
    if bound and n_chars > bound:
        raise ContextLengthError(
            f"The input has {n_chars} characters, more than can fit this model's maximum context length of "
            f"{max_len} tokens (at most {bound} characters). Please reduce the length of the input.", param=param)


@_structured(ChatRenderRequest.from_wire)
def run_render_chat(request: ChatRenderRequest) -> RenderedTokens:
    """The body of ``render_chat_task``, also the inline route's (``gateway.pipeline.rendering``): the task argument
    is a ``ChatRenderRequest`` on the wire (``inference.protocol.render``), the reply a ``RenderedTokens`` or a
    ``RenderFailure`` on the wire (``_structured``).

    With ``max_model_len``, text over ``prompt_char_bound`` raises ``ContextLengthError`` before rendering.
    ``client_chat_template`` is routing only: set when ``chat_template`` came from the client, so the api never runs
    it in-process (``gateway.pipeline.rendering.runs_inline``; ignored here). ``allow_control_tokens`` (default
    False): control-token strings in request text stay text. ``prompt_text`` is left out of the answer when
    ``return_prompt_text`` is False: the gateway reads only the ids, and the text would add the whole prompt to the
    reply's bytes.
    """
    check_chars(request, text_chars(request.messages), "messages")
    out = render_chat(request.tokenizer_dir, request.messages,
                      add_generation_prompt=request.add_generation_prompt,
                      continue_final_message=request.continue_final_message, tools=request.tools,
                      documents=request.documents, chat_template=request.chat_template,
                      chat_template_kwargs=request.chat_template_kwargs,
                      add_special_tokens=request.add_special_tokens,
                      allow_control_tokens=request.allow_control_tokens)
    return RenderedTokens(out.prompt_token_ids, out.prompt_text if request.return_prompt_text is not False else None)


@_structured(TokenizeRenderRequest.from_wire)
def run_tokenize_prompt(request: TokenizeRenderRequest) -> RenderedTokens:
    """A ``TokenizeRenderRequest`` → ``RenderedTokens`` (on the wire, ``_structured``); ``ContextLengthError``
    before encoding when the prompt has more characters than ``prompt_char_bound``."""
    check_chars(request, len(request.prompt) if isinstance(request.prompt, str) else 0, "prompt")
    return RenderedTokens(tokenize_prompt(request.tokenizer_dir, request.prompt,
                                          add_special_tokens=request.add_special_tokens))


@_structured(DetokenizeRenderRequest.from_wire)
def run_detokenize(request: DetokenizeRenderRequest) -> RenderedText:
    """A ``DetokenizeRenderRequest`` → ``RenderedText`` (on the wire ``{"ok": True, "prompt": str}``, vLLM's
    /detokenize field name)."""
    return RenderedText(detokenize(request.tokenizer_dir, request.tokens,
                                   skip_special_tokens=request.skip_special_tokens))


_reply_client: redis.Redis | None = None


def _link_prefix(reply_channel: str) -> str:
    """The link prefix of a reply channel (``<prefix>:render:reply:<id>``, ``render_client``)."""
    return reply_channel.split(":render:reply:")[0]


def _reply_redis() -> redis.Redis:
    """This worker's Redis client for replies: ``REDIS_URL`` (every platform process gets it), else the Celery app's
    result backend URL; made on first use."""
    global _reply_client
    if _reply_client is None:
        from celery import current_app

        _reply_client = redis.Redis.from_url(SETTINGS.redis_url or current_app.conf.result_backend)
    return _reply_client


def reply_if_requested(payload: Any, result: dict[str, Any]) -> dict[str, Any]:
    """Publish ``result`` on the caller's reply channel when the payload names one and return ``{"ok": ...,
    "replied": True}``; without a reply channel, return ``result`` (a Celery result backend then carries it).

    The segment cache's shared-tier entries this task encoded (``segment_cache.take_shared_writes``) are written in
    the same pipeline, before the reply, so that they are there for any request sent after it; with
    ``SEGMENT_CACHE_REDIS_URL`` (a Redis of the tier's own), in a pipeline of their own after the reply.

    The api process subscribes once to its own channel (``inference.api.render_client``) and sends tasks with
    ``ignore_result``, so no Celery result is stored and no per-request subscription is made. Redis is
    ``REDIS_URL`` (every platform process gets it), else the Celery app's result backend URL. The task's own return
    value then goes nowhere, but a prefork child still builds a ``saferepr`` of it (1 KiB of a ~1,000-id list, Python
    code) and pickles that to the worker's main process: the small stand-in spares both that work.
    """
    if isinstance(payload, dict) and payload.get("reply_to") and payload.get("reply_id"):
        channel = payload["reply_to"]
        prefix = _link_prefix(channel)
        pipe = _reply_redis().pipeline(transaction=False)
        pipe.incr(render_tasks_counter_key(prefix))  # shared count of rendered tasks (metrics, tests)
        count_segment_cache(pipe, prefix, result.get("segment_cache"))
        # the shared-tier entries first: Redis runs one connection's commands in order, so whichever worker renders
        # this conversation's next turn (after the reply below) finds them
        writes = segment_cache.take_shared_writes()
        separate = bool(SETTINGS.segment_cache_redis_url)  # the tier on a Redis of its own: written after the reply
        for key, value, ttl_s in () if separate else writes:
            pipe.set(key, value, ex=ttl_s)
        pipe.publish(channel, reply_json({"id": payload["reply_id"], "result": result}))
        pipe.execute()
        if separate and writes:
            _write_segment_tier(writes)
        return {"ok": result.get("ok"), "replied": True}
    segment_cache.take_shared_writes()  # not written without a reply pipeline
    return result


def _write_segment_tier(writes: list[tuple[str, bytes, int]]) -> None:
    """Write shared-tier entries to ``SEGMENT_CACHE_REDIS_URL``'s Redis in one pipeline; a failure loses them
    (logged at debug level), never the reply, which has already gone."""
    try:
        pipe = _segment_tier_redis().pipeline(transaction=False)
        for key, value, ttl_s in writes:
            pipe.set(key, value, ex=ttl_s)
        pipe.execute()
    except (redis.RedisError, OSError, ValueError):
        logger.debug("segment cache: the shared tier's writes failed", exc_info=True)


def reply_json(reply: dict[str, Any]) -> bytes:
    """``reply`` as JSON for the caller's ``json.loads``: orjson (a ~1,000-id render result in ~5 µs instead of
    ~40), or the standard library for what orjson refuses (integers past 64 bits, lone surrogates)."""
    try:
        return orjson.dumps(reply)
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(reply).encode()


def segment_cache_counter_key(prefix: str) -> str:
    """Redis hash of the segment tokenization cache's shared counters (fields ``hits``, ``shared_hits``, ``misses``:
    segments) under link prefix ``prefix``, summed over every render worker and inline api thread."""
    return f"{prefix}:metrics:segment_cache"


def count_segment_cache(pipe: Any, prefix: str, stats: Mapping[str, int] | None) -> None:
    """Queue on Redis pipeline ``pipe`` (sync or asyncio) the increments of a task's segment cache tallies
    (``RenderedTokens.segment_cache``: ``hits``, ``misses`` and, when any, ``shared_hits``); nothing for none."""
    if stats:
        key = segment_cache_counter_key(prefix)
        pipe.hincrby(key, "hits", int(stats.get("hits", 0)))
        pipe.hincrby(key, "misses", int(stats.get("misses", 0)))
        if stats.get("shared_hits"):
            pipe.hincrby(key, "shared_hits", int(stats["shared_hits"]))


def render_tasks_counter_key(prefix: str) -> str:
    """Redis counter of render/tokenize/mm tasks answered by any worker under link prefix ``prefix``."""
    return f"{prefix}:metrics:render_tasks_total"


def _render_task(name: str, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    """Bound ``shared_task`` named ``name`` with the render queue's time limits (``RENDER_TIME_LIMIT_S`` soft,
    ``RENDER_HARD_TIME_LIMIT_S`` hard; a ``solo`` worker enforces them itself, ``render_limits``), acknowledged when
    it ends (``acks_late``, DECISIONS D-190).

    A task whose worker's main process dies (``kill -9``, a lost machine, a ``solo`` worker's hard time limit)
    before it ended is still unacknowledged in the broker, which hands it back after the worker's visibility timeout
    (``CELERY_REDELIVER_AFTER_S``), fetched or started alike; the request is answered late, and a task handed back a
    second time is answered with an error instead of run (``run_task``). A task whose pool child dies under a live
    main process (``WorkerLostError``) is acknowledged and not run again (``task_reject_on_worker_lost`` off: Redis
    counts no deliveries, so a render that kills its process would be retried forever); the prefork hard time limit
    likewise acknowledges. Running twice is harmless: the first reply wins (``render_client``) and a render records
    nothing."""
    decorator: Callable[[Callable[..., Any]], Any] = shared_task(
        name=name, bind=True, soft_time_limit=RENDER_TIME_LIMIT_S, time_limit=RENDER_HARD_TIME_LIMIT_S,
        acks_late=True, reject_on_worker_lost=False, **options)
    return decorator


def _lost_twice(payload: Any) -> dict[str, Any]:
    """The error of a task not run again because its workers were lost twice while it ran: a client's own chat
    template is the likely cause (400), anything else is the server's (503, retry)."""
    what = "rendering this request stopped its render worker twice (time limit or a lost worker)"
    err: RenderError
    if isinstance(payload, dict) and payload.get("client_chat_template"):
        err = TemplateTimeoutError(f"{what}; it is not tried again", param="chat_template")
    else:
        err = RenderOverloadedError(f"{what}; it is not tried again")
    return _error(err)


def run_task(task: Any, payload: Any, body: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """Run a render task's ``body(payload)`` under ``render_limits.task_time_limits`` and reply
    (``reply_if_requested``). A copy the broker handed back or the api sent again, when such a copy of the same
    request already began (``render_limits.redelivery_refusal``), is answered with ``_lost_twice`` without running:
    a render that kills the worker running it (hard time limit) takes at most two. ``task``: the bound Celery task
    (its ``request.id`` and ``delivery_info``). Never raises (a soft limit reached while the body returns becomes
    its error dict)."""
    request = getattr(task, "request", None)
    redelivered = bool((getattr(request, "delivery_info", None) or {}).get("redelivered"))
    resent = isinstance(payload, dict) and bool(payload.get("resent"))  # the api sent it again (render_client)
    channel = payload.get("reply_to") if isinstance(payload, dict) else None
    # the shared segment tier: chat renders only (a long completion prompt is one segment, rarely sent again), under
    # the caller's link prefix (a caller with none, a result backend, gets none)
    segment_cache.shared_scope(
        _link_prefix(channel) if body is run_render_chat and isinstance(channel, str) and channel else None)
    try:
        if (redelivered or resent) and _refuse_redelivery(payload, getattr(request, "id", None)):
            return reply_if_requested(payload, _lost_twice(payload))
        try:
            with render_limits.task_time_limits():
                result = body(payload)
        except SoftTimeLimitExceeded as exc:  # fired between the body's return and the disarm
            result = _error(exc)
        return reply_if_requested(payload, result)
    finally:
        segment_cache.shared_scope(None)


def _refuse_redelivery(payload: Any, task_id: str | None) -> bool:
    """``render_limits.redelivery_refusal`` on the reply client's Redis under the payload's link prefix, counted per
    request (its ``reply_id``, shared by the api's copy sent again; else the task id); a Redis failure lets the copy
    run (the reply would fail the same way)."""
    channel = payload.get("reply_to") if isinstance(payload, dict) else None
    reply_id = payload.get("reply_id") if isinstance(payload, dict) else None
    # a caller with no reply channel (a Celery result backend) has no link prefix: task ids are unique anyway
    prefix = _link_prefix(channel) if isinstance(channel, str) else "celery-results"
    try:
        return render_limits.redelivery_refusal(_reply_redis(), prefix, str(reply_id or task_id or ""))
    except redis.RedisError:
        logger.warning("redelivery check failed; running the task", exc_info=True)
        return False


@_render_task("inference.render_chat")
def render_chat_task(self: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Celery task: render + tokenize a chat (see ``run_render_chat``)."""
    return run_task(self, payload, run_render_chat)


@_render_task("inference.tokenize_prompt")
def tokenize_prompt_task(self: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Celery task: tokenize a plain prompt (see ``run_tokenize_prompt``)."""
    return run_task(self, payload, run_tokenize_prompt)


@_render_task("inference.detokenize")
def detokenize_task(self: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Celery task: ids -> text (see ``run_detokenize``)."""
    return run_task(self, payload, run_detokenize)
