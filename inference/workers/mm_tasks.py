"""Celery tasks of queue ``mm``: multimodal preprocessing (docs/ARCHITECTURE.md §1 and §4).

Runs on its own queue so text rendering (queue ``render``) never waits behind an image; start workers with
``celery -A config worker -Q mm -c 1`` (concurrency 1 per worker, as many workers as wanted). The app must
import this module and route ``inference.mm_*`` to ``mm``: in ``config/settings.py``
``CELERY_IMPORTS = ["inference.workers.mm_tasks"]`` and ``CELERY_TASK_ROUTES["inference.mm_*"] = {"queue": "mm"}``
(callers also pass ``queue="mm"`` explicitly, so routing is belt and braces). A worker can also load it with
``-I inference.workers.mm_tasks``.

The task takes an ``inference.protocol.render.ImagesRequest`` on the wire and answers ``PreprocessedImages``
(``{"ok": True, "items": [{"key", "num_tokens", "cached"}]}``) or a ``RenderFailure`` (``{"ok": False, "error":
{"type", "message", "param", "code"}}``: ``ImageError`` with its code, a client error; ``ImageTimeoutError``, code
``image_timeout``, when the time limit fired; ``InternalError``, code ``mm_internal_error``, for a bug).
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery import current_app, shared_task

from inference.shared.config import SETTINGS
from inference.protocol.errors import ErrorCode
from inference.protocol.render import (
    MM_QUEUE,
    TASK_MM_PREPROCESS,
    ImageFeatures,
    ImagesRequest,
    PreprocessedImages,
    RenderFailure,
    Wire,
)
from inference.workers.tasks import reply_if_requested
from celery.exceptions import SoftTimeLimitExceeded

from inference.media.image import ImageError
from inference.renderer.multimodal import preprocess_images

logger = logging.getLogger(__name__)

MM_TIME_LIMIT_S = SETTINGS.mm_time_limit_s
__all__ = ["MM_QUEUE", "MM_TIME_LIMIT_S", "mm_preprocess_task", "mm_tasks_counter_key", "run_mm_preprocess"]
_client: redis.Redis | None = None


def _redis() -> redis.Redis:
    """This worker's Redis: ``REDIS_URL`` (every platform process gets it), else the Celery app's broker URL.
    Task messages never carry a URL (an embedded Redis's URL holds its password)."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(SETTINGS.redis_url or current_app.conf.broker_url)
    return _client


def mm_tasks_counter_key(prefix: str) -> str:
    """Redis counter of ``mm`` preprocessing tasks started under link prefix ``prefix`` (tests, metrics)."""
    return f"{prefix}:mm:tasks_total"


def preprocess(request: ImagesRequest) -> PreprocessedImages | RenderFailure:
    """The images of ``request`` processed into the shared feature cache (``preprocess_images``), or the failure:
    ``ImageError`` (a client error, its code), ``ImageTimeoutError`` (the soft time limit), ``InternalError`` (a
    bug, logged). Never raises for a client error."""
    try:
        _redis().incr(mm_tasks_counter_key(request.prefix))
        items = preprocess_images(_redis(), request.prefix, request.model_dir,
                                  [it.to_wire() for it in request.items], request.allowed_domains,
                                  request.max_bytes, request.cache_salt)
        return PreprocessedImages([ImageFeatures.from_wire(it) for it in items])
    except ImageError as exc:
        return RenderFailure("ImageError", exc.message, exc.param, exc.code)
    except SoftTimeLimitExceeded:
        return RenderFailure.of("ImageTimeoutError", f"image preprocessing took longer than {MM_TIME_LIMIT_S:g} s",
                                "messages")
    except Exception as exc:
        logger.exception("mm preprocessing failed unexpectedly")
        return RenderFailure("InternalError", f"{type(exc).__name__}: {exc}", None, ErrorCode.MM_INTERNAL_ERROR)


def run_mm_preprocess(payload: Any) -> Wire:
    """The task body on the wire: an ``ImagesRequest`` argument → ``preprocess``'s answer (module docstring). A
    malformed argument is an ``InternalError`` (only the api sends these)."""
    try:
        request = ImagesRequest.from_wire(payload)
    except Exception as exc:
        logger.exception("mm task argument unreadable")
        return RenderFailure("InternalError", f"{type(exc).__name__}: {exc}", None,
                             ErrorCode.MM_INTERNAL_ERROR).to_wire()
    return preprocess(request).to_wire()


@shared_task(name=TASK_MM_PREPROCESS, soft_time_limit=MM_TIME_LIMIT_S, time_limit=MM_TIME_LIMIT_S + 5)
def mm_preprocess_task(payload: dict[str, Any]) -> dict[str, Any]:
    """Celery task: fetch/decode/process the images of one request (see ``run_mm_preprocess``)."""
    return reply_if_requested(payload, run_mm_preprocess(payload))
