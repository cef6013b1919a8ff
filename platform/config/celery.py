"""The Celery application ``config`` (``celery -A config worker -Q render,usage,celery``).

Configuration comes from Django settings under the ``CELERY_`` namespace (see ``config.settings``):
broker and result backend on ``REDIS_URL``; routes ``inference.*render*``, ``inference.tokenize*``,
``inference.detokenize*`` -> queue ``render`` and ``usage.*`` -> queue ``usage``; beat runs
``usage.flush_usage_events`` every second.
"""

from __future__ import annotations

import importlib.util
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")


def _inference_tasks_present() -> bool:
    """True when the Django-free ``inference.tasks`` module exists (it is imported by workers, not here)."""
    try:
        return importlib.util.find_spec("inference.tasks") is not None
    except ModuleNotFoundError:  # no ``inference`` package on sys.path
        return False


# inference.tasks is included explicitly: it is not a Django app, so autodiscovery would not find it.
app = Celery("config", include=["inference.tasks"] if _inference_tasks_present() else [])
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
