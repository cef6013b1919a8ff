"""Celery tasks of queue ``mm``: multimodal preprocessing (DESIGN.md §1 and §4).

Runs on its own queue so text rendering (queue ``render``) never waits behind an image; start workers with
``celery -A config worker -Q mm -c 1`` (concurrency 1 per worker, as many workers as wanted). The app must
import this module and route ``inference.mm_*`` to ``mm``: in ``config/settings.py``
``CELERY_IMPORTS = ["inference.mm_tasks"]`` and ``CELERY_TASK_ROUTES["inference.mm_*"] = {"queue": "mm"}``
(callers also pass ``queue="mm"`` explicitly, so routing is belt and braces). A worker can also load it with
``-I inference.mm_tasks``.

Result: ``{"ok": True, "items": [{"key", "num_tokens", "cached"}]}`` or ``{"ok": False, "error": {"type",
"message", "param", "code"}}`` (``ImageError`` → HTTP 400; ``InternalError`` → 500; time limit →
``ImageTimeoutError`` → 400).
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery import current_app, shared_task

from inference.config import SETTINGS
from inference.tasks import reply_if_requested
from celery.exceptions import SoftTimeLimitExceeded

from inference.media.image import ImageError
from inference.renderer.multimodal import preprocess_images

logger = logging.getLogger(__name__)

MM_TIME_LIMIT_S = SETTINGS.mm_time_limit_s
MM_QUEUE = "mm"
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


def run_mm_preprocess(payload: dict[str, Any]) -> dict[str, Any]:
    """payload ``{"prefix", "model_dir", "items": [{"part", "url"}], "allowed_domains"?:
    [str], "max_bytes"?: int, "cache_salt"?: str}`` → result dict (module docstring). Never raises for client
    errors."""
    try:
        _redis().incr(mm_tasks_counter_key(payload["prefix"]))
        items = preprocess_images(_redis(), payload["prefix"], payload["model_dir"],
                                  payload["items"], payload.get("allowed_domains"), payload.get("max_bytes"),
                                  payload.get("cache_salt"))
        return {"ok": True, "items": items}
    except ImageError as exc:
        return {"ok": False, "error": exc.to_dict()}
    except SoftTimeLimitExceeded:
        return {"ok": False, "error": {"type": "ImageTimeoutError", "param": "messages", "code": "image_timeout",
                                       "message": f"image preprocessing took longer than {MM_TIME_LIMIT_S:g} s"}}
    except Exception as exc:
        logger.exception("mm preprocessing failed unexpectedly")
        return {"ok": False, "error": {"type": "InternalError", "message": f"{type(exc).__name__}: {exc}",
                                       "param": None, "code": "mm_internal_error"}}


@shared_task(name="inference.mm_preprocess", soft_time_limit=MM_TIME_LIMIT_S, time_limit=MM_TIME_LIMIT_S + 5)
def mm_preprocess_task(payload: dict[str, Any]) -> dict[str, Any]:
    """Celery task: fetch/decode/process the images of one request (see ``run_mm_preprocess``)."""
    return reply_if_requested(payload, run_mm_preprocess(payload))
