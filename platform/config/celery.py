"""The Celery application ``config`` (``celery -A config worker -Q render``, ``-Q usage``, ``-Q mm``).

Configuration comes from Django settings under the ``CELERY_`` namespace (see ``config.settings``):
broker and result backend on ``REDIS_URL``; routes ``inference.*render*``, ``inference.tokenize*``,
``inference.detokenize*`` -> queue ``render`` and ``usage.*`` -> queue ``usage``; beat runs
``usage.flush_usage_events`` every second.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import threading
import time
from typing import Any

import redis
from celery import Celery, bootsteps
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.signals import worker_init, worker_process_init
from django.conf import settings

from config.gc_tuning import freeze_startup_objects
from inference.api.render_liveness import HEARTBEAT_INTERVAL_S, beat

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")


def _inference_tasks_present() -> bool:
    """True when the Django-free ``inference.workers.tasks`` module exists (it is imported by workers, not here)."""
    try:
        return importlib.util.find_spec("inference.workers.tasks") is not None
    except ModuleNotFoundError:  # no ``inference`` package on sys.path
        return False


# inference.workers.tasks is included explicitly: it is not a Django app, so autodiscovery would not find it.
app = Celery("config", include=["inference.workers.tasks"] if _inference_tasks_present() else [])
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


# Set to 1 by a prefork child once it has loaded the renderer (``_init_child``); made by the main process before it
# forks its pool (``worker_init``), so every child writes the same shared byte.
_child_ready: Any = None  # a ctypes.c_byte in shared memory


@worker_init.connect
def _init_main(**_kwargs) -> None:
    """The worker's main process, before its pool starts: the shared "a child is ready" flag."""
    global _child_ready
    _child_ready = multiprocessing.Value("b", 0, lock=False)


class RenderHeartbeat(bootsteps.StartStopStep):
    """A worker consuming the ``render`` queue beats every ``HEARTBEAT_INTERVAL_S`` (``inference.api.render_liveness``:
    the api waits for a render worker to come back rather than refusing after a fixed time; D-191): a prefork worker
    from its main process's event loop, once one of its children has loaded the renderer (a replacement worker's
    children take 10-30 s to warm up on a loaded 2-core machine: beating before would start the api's render timeout
    while nothing can render); a ``solo`` worker, which loaded the renderer before it consumes and whose loop waits
    while it renders, from a thread of its main process (the beats stop while a task holds the GIL in C code).
    Stops with the consumer."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent, **kwargs):
        super().__init__(parent, **kwargs)
        self._tref = None
        self._client: redis.Redis | None = None
        self._failing = False
        self._wait_for_child = False
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self, parent) -> None:
        """Beat now and then on the consumer's timer, for a worker that consumes ``render``."""
        if "render" not in (parent.app.amqp.queues.consume_from or {}):
            return
        self._client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
        self._wait_for_child = isinstance(parent.pool, PreforkPool) and _child_ready is not None
        self._beat()
        if isinstance(parent.pool, PreforkPool):
            self._tref = parent.timer.call_repeatedly(HEARTBEAT_INTERVAL_S, self._beat, priority=10)
        else:  # a solo worker's loop waits while it renders: beat from a thread (it stops if the GIL is held)
            self._stopping = threading.Event()
            self._thread = threading.Thread(target=self._beat_until_stopped, name="render-heartbeat", daemon=True)
            self._thread.start()

    def _beat_until_stopped(self) -> None:
        while not self._stopping.wait(HEARTBEAT_INTERVAL_S):
            self._beat()

    def stop(self, parent) -> None:
        """Stop beating (the api sees no render worker ``STALE_AFTER_S`` later unless another one beats)."""
        if self._tref is not None:
            self._tref.cancel()
            self._tref = None
        if self._thread is not None:
            self._stopping.set()
            self._thread.join(timeout=HEARTBEAT_INTERVAL_S + 3)
            self._thread = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def _beat(self) -> None:
        if self._client is None or (self._wait_for_child and _child_ready is not None and not _child_ready.value):
            return
        try:
            beat(self._client, settings.LINK_PREFIX)
            self._failing = False
        except redis.RedisError as exc:  # Redis down: the consumer itself reconnects; log once per outage
            if not self._failing:
                logging.getLogger("config.celery").warning("render heartbeat failed: %s", exc)
            self._failing = True


app.steps["consumer"].add(RenderHeartbeat)


@worker_process_init.connect
def _init_child(**_kwargs) -> None:
    """Each prefork child: a render worker's child loads the tokenizers and chat templates of the enabled
    served models now (a cold child took 1-3 s on its first request under load, and up to the 5 s render limit
    with four children loading at once), then start-up objects leave the collector's walks
    (``config.gc_tuning``)."""
    if "render" in (app.amqp.queues.consume_from or {}):
        warmed: set[tuple[str, str]] = set()
        _warm_renderer(warmed)
        if _child_ready is not None:
            _child_ready.value = 1  # the main process's heartbeat may begin (RenderHeartbeat)
        threading.Thread(target=_keep_warm, args=(warmed,), name="render-warm", daemon=True).start()
    freeze_startup_objects()


# Seconds between two looks of a render child at the registry for models registered (or changed) since it started.
WARM_POLL_S = 5.0


def _keep_warm(warmed: set[tuple[str, str]]) -> None:
    """A render child's background thread: every ``WARM_POLL_S`` seconds, warm the enabled models it has not warmed
    yet, so a model registered while the workers run is loaded before (or while) its first request waits, not inside
    that request's render time limit (a cold load of a 200k-token vocabulary took past the 5 s limit under load)."""
    from django.db import connection

    while True:
        time.sleep(WARM_POLL_S)
        try:
            _warm_renderer(warmed, quiet=True)
        finally:
            connection.close()  # this thread's own connection: none is held between looks


def _warm_renderer(warmed: set[tuple[str, str]], quiet: bool = False) -> None:
    """Load the tokenizer and chat template of every enabled generate/embed model whose ``(tokenizer dir, template)``
    is not in ``warmed`` yet (then added); failures are logged, never raised (the request that needs a broken
    tokenizer gets the error). ``quiet``: no log line when there was nothing new."""
    # Lazy: this module is imported with the settings (config/__init__.py), before the apps (registry's models)
    # are ready, and by processes that never render (api, usage worker, beat), which need not load the renderer.
    from inference.renderer.chat_template import warm_up
    from registry.selectors import served_models_enabled

    log = logging.getLogger("config.celery")
    try:
        models = list(served_models_enabled())
    except Exception:  # no database yet (first migrate pending), or it is restarting: warm on the next look
        if not quiet:
            log.warning("render warm-up skipped: the model registry is not readable", exc_info=True)
        return
    t0 = time.monotonic()
    new = [m for m in models if (m.tokenizer_dir_resolved, m.chat_template or "") not in warmed]
    for m in new:
        key = (m.tokenizer_dir_resolved, m.chat_template or "")
        try:
            warm_up(key[0], key[1] or None)
        except Exception as exc:  # noqa: BLE001
            log.warning("render warm-up of %s failed: %s", m.served_model_name, exc)
        warmed.add(key)  # a broken one is not tried again every few seconds: its requests get its error
    if new or not quiet:
        log.info("render warm-up: %d model(s) in %.2f s", len(new), time.monotonic() - t0)
