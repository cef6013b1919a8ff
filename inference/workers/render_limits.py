"""Time limits and a redelivery guard for render tasks that run in their worker's main process (Celery's ``solo``
pool; DECISIONS D-296).

Celery enforces a task's ``soft_time_limit`` and ``time_limit`` only in its ``prefork`` pool, where a parent process
signals or kills the child running the task. A ``solo`` worker runs each task in its own main process (no pool
hop: 16-25 % less CPU per ``/tokenize`` request measured on the 2-core box), so it gets both limits from here:

* soft: ``signal.setitimer(ITIMER_REAL)``; its ``SIGALRM`` raises Celery's own ``SoftTimeLimitExceeded`` in the
  task, between two Python bytecodes, as the prefork child's ``SIGUSR1`` does;
* hard: a watchdog process forked by ``enable`` reads the task's deadline from shared memory (one store per task,
  no thread per task) and, once it has passed, sends ``SIGUSR2``, on which ``faulthandler`` writes the
  Python stacks to stderr from C, then ``SIGKILL``. Both act with no help from the worker's Python code, so a task
  stuck in C code holding the GIL is stopped too. The worker's supervisor starts a new one (``serve``, systemd,
  Kubernetes). The task is unacknowledged (``acks_late``), so the broker hands it back after the visibility timeout:
  ``redelivery_refusal`` bounds how often a task that kills its worker runs again.

Only a worker arms them (``enable``, from the worker's start signal): any other process that calls a task body in
its main thread (a test runner, a shell) keeps its own ``SIGALRM`` and is never exited.
"""

from __future__ import annotations

import faulthandler
import logging
import mmap
import os
import signal
import struct
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from celery.exceptions import SoftTimeLimitExceeded

# Seconds a refused-redelivery marker lives: longer than any render's whole wait (the api's timeout plus the time it
# waits for a lost worker's return), so a task handed back twice is still known when its second copy arrives.
REDELIVERY_MARK_TTL_S = 600

# The watchdog looks at the deadline this often (seconds): the hard limit is enforced within this much past it.
WATCHDOG_POLL_S = 0.1
# Seconds between the stack dump (SIGUSR2) and SIGKILL.
DUMP_GRACE_S = 0.5

_soft_s: float | None = None  # the soft limit once ``enable`` ran in this worker
_hard_s = 0.0
_deadline: mmap.mmap | None = None  # 8 bytes shared with the watchdog: CLOCK_MONOTONIC deadline, 0.0 = no task
_armed = False
_watchdog_pid = 0
_DOUBLE = struct.Struct("d")
log = logging.getLogger(__name__)


def _on_alarm(_signum: int, _frame: Any) -> None:
    if _armed:
        raise SoftTimeLimitExceeded("soft time limit exceeded")


def _watch(deadline: mmap.mmap, pid: int) -> None:
    """The watchdog process's loop: while ``pid`` is its parent, once the deadline in ``deadline`` has passed, dump
    the parent's stacks (``SIGUSR2``) and kill it (``SIGKILL``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the worker handles it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while os.getppid() == pid:
        due = _DOUBLE.unpack_from(deadline)[0]
        if due and time.monotonic() > due:
            os.kill(pid, signal.SIGUSR2)
            time.sleep(DUMP_GRACE_S)
            if os.getppid() == pid:
                os.kill(pid, signal.SIGKILL)
            return
        time.sleep(WATCHDOG_POLL_S)


def enable(soft_s: float, hard_s: float) -> None:
    """Arm ``task_time_limits`` in this process: soft limit ``soft_s`` and hard limit ``hard_s`` seconds of wall time
    per task (``hard_s`` > ``soft_s`` > 0). Call once, from the main thread of a worker process that runs tasks
    itself (the ``solo`` pool), before it starts other threads: installs the ``SIGALRM`` handler and ``faulthandler``
    on ``SIGUSR2``, and forks the watchdog process (it exits when this process does). Raises ``ValueError`` for
    limits out of order, ``RuntimeError`` when called twice."""
    global _soft_s, _hard_s, _deadline
    if not 0 < soft_s < hard_s:
        raise ValueError(f"time limits must satisfy 0 < soft < hard, got soft={soft_s} hard={hard_s}")
    if _deadline is not None:
        raise RuntimeError("render time limits are already enabled in this process")
    signal.signal(signal.SIGALRM, _on_alarm)
    faulthandler.register(signal.SIGUSR2, file=sys.__stderr__ or 2, all_threads=True)
    _deadline, _soft_s, _hard_s = mmap.mmap(-1, _DOUBLE.size), soft_s, hard_s
    _fork_watchdog()


def _fork_watchdog() -> None:
    global _watchdog_pid
    assert _deadline is not None
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the watchdog: nothing but the loop, then out without the parent's exit handlers
        try:
            _watch(_deadline, parent)
        finally:
            os._exit(0)
    _watchdog_pid = pid


def watchdog_pid() -> int:
    """The pid of this worker's watchdog process (0 before ``enable``)."""
    return _watchdog_pid


def _ensure_watchdog() -> None:
    """Start another watchdog when this worker's has exited (killed by someone): one ``waitpid`` per task."""
    try:
        gone, _ = os.waitpid(_watchdog_pid, os.WNOHANG)
    except ChildProcessError:  # reaped by someone else
        gone = _watchdog_pid
    if gone:
        log.warning("the render time-limit watchdog (pid %d) exited; starting another", _watchdog_pid)
        _fork_watchdog()


@contextmanager
def task_time_limits() -> Iterator[None]:
    """The body of a ``with``: ``SoftTimeLimitExceeded`` raised in it after the soft limit; the process is killed
    (Python stacks on stderr, then ``SIGKILL``) after the hard limit. Nothing when ``enable`` did not run here or
    when called off the main thread (the inline pool's threads in the api)."""
    global _armed
    if _soft_s is None or _deadline is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    _ensure_watchdog()
    _DOUBLE.pack_into(_deadline, 0, time.monotonic() + _hard_s)
    _armed = True
    signal.setitimer(signal.ITIMER_REAL, _soft_s)
    try:
        yield
    finally:
        _armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        _DOUBLE.pack_into(_deadline, 0, 0.0)


def redelivery_mark_key(prefix: str, request_id: str) -> str:
    """Redis counter of the second copies (handed back or sent again) of render request ``request_id`` that came to
    a worker, under link prefix ``prefix``."""
    return f"{prefix}:render:redelivered:{request_id}"


def redelivery_refusal(client: Any, prefix: str, request_id: str | None) -> bool:
    """Whether a second copy of a render (one the broker handed back, kombu's ``redelivered`` flag, or one the api
    sent again; the caller asks only for those: a first copy costs nothing) must not run: True when an earlier such
    copy of request ``request_id`` already came, so the request's render was started at least twice before. The
    first copy again runs (a worker killed by an operator, the OOM killer or a lost machine: the request is answered
    late); a render that kills every worker that runs it (the hard time limit) thus takes at most two. ``client``: a
    synchronous Redis client (one ``INCR`` + ``EXPIRE``). Raises ``redis.RedisError``."""
    if not request_id:
        return False
    key = redelivery_mark_key(prefix, request_id)
    pipe = client.pipeline(transaction=False)
    pipe.incr(key)
    pipe.expire(key, REDELIVERY_MARK_TTL_S)
    count, _ = pipe.execute()
    return int(count) > 1
