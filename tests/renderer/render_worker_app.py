"""A minimal Celery app for tests/renderer/test_render_tasks.py: runs ``inference.workers.tasks`` in a real
worker (prefork or solo) on Redis, without Django (the project app in platform/config needs settings)."""

from __future__ import annotations

import os

from celery import Celery

REDIS_URL = os.environ.get("RENDER_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")

app = Celery("render_tasks_test", broker=REDIS_URL, backend=REDIS_URL, include=["inference.workers.tasks"])
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
