"""The Celery application ``config`` (``celery -A config worker -Q render``, ``-Q usage``, ``-Q mm``).

Configuration comes from Django settings under the ``CELERY_`` namespace (see ``config.settings``):
broker and result backend on ``REDIS_URL``; routes ``inference.*render*``, ``inference.tokenize*``,
``inference.detokenize*`` -> queue ``render`` and ``usage.*`` -> queue ``usage``; beat runs
``usage.flush_usage_events`` every second.
"""

from __future__ import annotations

import importlib.util
import os
import time

from celery import Celery
from celery.signals import worker_process_init

from config.gc_tuning import freeze_startup_objects

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


@worker_process_init.connect
def _init_child(**_kwargs) -> None:
    """Each prefork child: a render worker's child loads the tokenizers and chat templates of the enabled
    served models now (a cold child took 1-3 s on its first request under load, and up to the 5 s render limit
    with four children loading at once), then start-up objects leave the collector's walks
    (``config.gc_tuning``)."""
    if "render" in (app.amqp.queues.consume_from or {}):
        _warm_renderer()
    freeze_startup_objects()


def _warm_renderer() -> None:
    """Load every enabled generate/embed model's tokenizer and chat template; failures are logged, never raised
    (the request that needs a broken tokenizer gets the error)."""
    import logging

    # Lazy: this module is imported with the settings (config/__init__.py), before the apps (registry's models)
    # are ready, and by processes that never render (api, usage worker, beat), which need not load the renderer.
    from inference.renderer.chat_template import warm_up
    from registry.selectors import served_models_enabled

    log = logging.getLogger("config.celery")
    try:
        models = list(served_models_enabled())
    except Exception:  # no database yet (first migrate pending): nothing to warm
        log.warning("render warm-up skipped: the model registry is not readable", exc_info=True)
        return
    t0 = time.monotonic()
    for m in models:
        try:
            warm_up(m.tokenizer_dir_resolved, m.chat_template or None)
        except Exception as exc:  # noqa: BLE001
            log.warning("render warm-up of %s failed: %s", m.served_model_name, exc)
    log.info("render warm-up: %d model(s) in %.2f s", len(models), time.monotonic() - t0)
