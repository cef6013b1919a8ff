"""The Celery application ``config`` (``celery -A config worker -Q render,usage,celery``).

Configuration comes from Django settings under the ``CELERY_`` namespace (see ``config.settings``):
broker and result backend on ``REDIS_URL``; routes ``inference.*render*``, ``inference.tokenize*``,
``inference.detokenize*`` -> queue ``render`` and ``usage.*`` -> queue ``usage``; beat runs
``usage.flush_usage_events`` every second.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("config", include=["inference.tasks"])
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
