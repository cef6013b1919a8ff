"""``manage.py`` commands for a test platform, run by one long-lived Django process instead of a new one per command.

A ``manage.py`` process spends 1.3-3 s starting (Django, the apps, the inference modules they import) before a
command such as ``create_api_key`` does its ~10 ms of work; the suite ran ~200 such commands (keys, limits, models),
several minutes of a 2-core machine. ``ManageRunner`` starts ``python -m harness.manage_runner`` once with the
platform's environment and sends it one command at a time; the child runs each with Django's ``call_command`` (the
same parser and ``handle`` as ``manage.py``), captures what it prints, closes its database connections after each
command (a test may restart PostgreSQL between two commands) and answers on a pipe of its own, so nothing a command
prints can be mistaken for an answer.

Protocol: requests are JSON lines on the child's stdin, ``{"args": [...]}``; answers are JSON lines on the file
descriptor given as the child's argument: ``{"ok": true, "stdout": "..."}`` or ``{"ok": false, "error": "..."}``.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import select
import subprocess
import sys
import threading
import time
import traceback
from collections import OrderedDict

from harness import REPO


class ManageRunner:
    """One child process running ``manage.py`` commands with ``env`` (its ``DATABASE_URL``, ``REDIS_URL``,
    ``LINK_PREFIX``...), started on first use. Thread-safe: commands run one at a time."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self._proc: subprocess.Popen | None = None
        self._answers: int | None = None
        self._buffer = b""
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        read_fd, write_fd = os.pipe()
        proc = subprocess.Popen([sys.executable, "-m", "harness.manage_runner", str(write_fd)], env=self.env,
                                cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                pass_fds=(write_fd,))
        os.close(write_fd)
        self._proc, self._answers, self._buffer = proc, read_fd, b""
        return proc

    def run(self, *args: str, timeout: float = 120) -> str:
        """Run ``manage.py ARGS``; its stdout. ``RuntimeError`` (with the command's error) when it fails;
        ``TimeoutError`` (the child is killed, the next command starts a new one) past ``timeout`` seconds."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                self._shutdown()  # a child that died: its pipe closed before a new one starts
                proc = self._start()
            assert proc.stdin is not None and self._answers is not None
            try:
                proc.stdin.write(json.dumps({"args": list(args)}).encode() + b"\n")
                proc.stdin.flush()
            except BrokenPipeError:
                pass  # the child died; reading its answer below says so
            answer = self._read_answer(proc, timeout, args)
        if not answer["ok"]:
            raise RuntimeError(f"manage.py {' '.join(args)} failed: {answer['error'][-3000:]}")
        return str(answer["stdout"])

    def _read_answer(self, proc: subprocess.Popen, timeout: float, args: tuple[str, ...]) -> dict:
        assert self._answers is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self._shutdown()
                raise TimeoutError(f"manage.py {' '.join(args)} took more than {timeout} s")
            ready, _, _ = select.select([self._answers], [], [], min(left, 1.0))
            chunk = os.read(self._answers, 1 << 20) if ready else b""
            if ready and not chunk:  # the child exited without an answer
                stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                self._shutdown()
                raise RuntimeError(f"manage.py {' '.join(args)} failed: the runner exited: {stderr[-3000:]}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return dict(json.loads(line))

    def close(self) -> None:
        """Stop the child (at most 5 s for it to leave on its own), if it runs; waits for a command running."""
        with self._lock:
            self._shutdown()

    def _shutdown(self) -> None:
        proc, self._proc = self._proc, None
        if self._answers is not None:
            os.close(self._answers)
            self._answers = None
        if proc is None:
            return
        with contextlib.suppress(Exception):
            if proc.stdin:
                proc.stdin.close()
            proc.wait(5)
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        if proc.stderr:
            proc.stderr.close()


_RUNNERS: OrderedDict[tuple[tuple[str, str], ...], ManageRunner] = OrderedDict()
_RUNNERS_LOCK = threading.Lock()
KEEP_RUNNERS = 4  # an idle runner holds ~150 MB; platforms of a test session mostly run one after another


def runner_for(env: dict[str, str]) -> ManageRunner:
    """The runner kept for an environment equal to ``env`` (made on first use); the least recently used one is
    stopped when more than ``KEEP_RUNNERS`` are kept. All are stopped when the interpreter exits."""
    key = tuple(sorted(env.items()))
    with _RUNNERS_LOCK:
        runner = _RUNNERS.pop(key, None) or ManageRunner(dict(env))
        _RUNNERS[key] = runner
        while len(_RUNNERS) > KEEP_RUNNERS:
            _RUNNERS.popitem(last=False)[1].close()
        return runner


@atexit.register
def _close_all() -> None:
    with _RUNNERS_LOCK:
        while _RUNNERS:
            _RUNNERS.popitem()[1].close()


def _serve(answer_fd: int) -> None:
    """The child: set Django up once, then run each command read from stdin (see the module docstring)."""
    sys.path[:0] = [str(REPO / "platform"), str(REPO)]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django
    from django.core.management import call_command
    from django.db import connections

    django.setup()
    answers = os.fdopen(answer_fd, "wb", buffering=0)
    for raw in sys.stdin.buffer:
        args = json.loads(raw)["args"]
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                call_command(*args, stdout=out)
            answer = {"ok": True, "stdout": out.getvalue()}
        except (Exception, SystemExit):  # noqa: BLE001 - every failure goes back to the caller
            answer = {"ok": False, "error": out.getvalue() + traceback.format_exc()}
        finally:
            connections.close_all()
        answers.write(json.dumps(answer).encode() + b"\n")


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
