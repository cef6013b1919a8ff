"""Time limits and a redelivery guard for render tasks that run in their worker's main process (Celery's ``solo``
pool; DECISIONS D-296).

Celery enforces a task's ``soft_time_limit`` and ``time_limit`` only in its ``prefork`` pool, where a parent process
signals or kills the child running the task. A ``solo`` worker runs each task in its own main process (no pool
hop: 18 % less CPU per ``/tokenize`` request measured on the 2-core box), so it gets both limits from here:

* soft: ``signal.setitimer(ITIMER_REAL)``; its ``SIGALRM`` raises Celery's own ``SoftTimeLimitExceeded`` in the
  task, between two Python bytecodes, as the prefork child's ``SIGUSR1`` does;
* hard: ``faulthandler.dump_traceback_later(exit=True)``, whose watchdog is a C thread that needs no GIL: a task
  stuck in C code holding the GIL is stopped too. The process writes its Python stacks to stderr and exits with
  status 1; its supervisor starts a new one (``serve``, systemd, Kubernetes). The task is unacknowledged
  (``acks_late``), so the broker hands it back after the visibility timeout: ``redelivery_refusal`` bounds how often
  a task that kills its worker runs again.

Only a worker arms them (``enable``, from the worker's start signal): any other process that calls a task body in
its main thread (a test runner, a shell) keeps its own ``SIGALRM`` and is never exited.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from celery.exceptions import SoftTimeLimitExceeded

# Seconds a refused-redelivery marker lives: longer than any render's whole wait (the api's timeout plus the time it
# waits for a lost worker's return), so a task handed back twice is still known when its second copy arrives.
REDELIVERY_MARK_TTL_S = 600

_limits: tuple[float, float] | None = None  # (soft, hard) seconds once ``enable`` ran in this worker
_armed = False


def _on_alarm(_signum: int, _frame: Any) -> None:
    if _armed:
        raise SoftTimeLimitExceeded("soft time limit exceeded")


def enable(soft_s: float, hard_s: float) -> None:
    """Arm ``task_time_limits`` in this process: soft limit ``soft_s`` and hard limit ``hard_s`` seconds of wall time
    per task (``hard_s`` > ``soft_s`` > 0). Call from the main thread of a worker process that runs tasks itself
    (the ``solo`` pool); installs the ``SIGALRM`` handler. Raises ``ValueError`` for limits out of order."""
    global _limits
    if not 0 < soft_s < hard_s:
        raise ValueError(f"time limits must satisfy 0 < soft < hard, got soft={soft_s} hard={hard_s}")
    signal.signal(signal.SIGALRM, _on_alarm)
    _limits = (soft_s, hard_s)


def enabled() -> bool:
    """True once ``enable`` ran in this process."""
    return _limits is not None


@contextmanager
def task_time_limits() -> Iterator[None]:
    """The body of a ``with``: ``SoftTimeLimitExceeded`` raised in it after the soft limit; the process exits
    (status 1, Python stacks on stderr) after the hard limit. Nothing when ``enable`` did not run here or when
    called off the main thread (the inline pool's threads in the api)."""
    global _armed
    if _limits is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    soft_s, hard_s = _limits
    faulthandler.dump_traceback_later(hard_s, exit=True, file=sys.__stderr__ or 2)
    _armed = True
    signal.setitimer(signal.ITIMER_REAL, soft_s)
    try:
        yield
    finally:
        _armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()


def redelivery_mark_key(prefix: str, task_id: str) -> str:
    """Redis counter of the redelivered copies of task ``task_id`` that began running, under link prefix ``prefix``."""
    return f"{prefix}:render:redelivered:{task_id}"


def redelivery_refusal(client: Any, prefix: str, task_id: str | None, redelivered: bool) -> bool:
    """Whether a task must not run again: True when it is a redelivered copy (``redelivered``: kombu's flag on a
    message the broker handed back) and an earlier redelivered copy of the same ``task_id`` already began, so the
    task's worker was lost at least twice while it ran. The first redelivery runs (a worker killed by an operator,
    the OOM killer or a lost machine: the request is answered late); a task whose run kills every worker that takes
    it (the hard time limit) thus takes at most two. ``client``: a synchronous Redis client (one ``INCR`` + ``EXPIRE``,
    only for redelivered copies). Raises ``redis.RedisError``."""
    if not redelivered or not task_id:
        return False
    key = redelivery_mark_key(prefix, task_id)
    pipe = client.pipeline(transaction=False)
    pipe.incr(key)
    pipe.expire(key, REDELIVERY_MARK_TTL_S)
    count, _ = pipe.execute()
    return int(count) > 1
