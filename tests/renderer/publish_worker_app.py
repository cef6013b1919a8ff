"""A Celery app for tests/renderer/test_celery_publish.py: the render tasks in a real prefork worker on Redis under
the test's key prefix (``PUBLISH_TEST_PREFIX``), without Django."""

from __future__ import annotations

import os

from celery import Celery

REDIS_URL = os.environ.get("PUBLISH_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")
os.environ.setdefault("REDIS_URL", REDIS_URL)  # where the tasks publish their replies (inference.workers.tasks)

app = Celery("publish_test", broker=REDIS_URL, include=["inference.workers.tasks"])
app.conf.update(
    broker_transport_options={"global_keyprefix": f"{os.environ.get('PUBLISH_TEST_PREFIX', 'publish')}:celery:"},
    task_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
