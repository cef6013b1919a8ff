"""Helpers for tests that run ``manage.py serve`` itself."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import IO

import pytest


def serve_banner(stdout: IO[str], timeout_s: float) -> list[str]:
    """The lines ``manage.py serve`` printed on ``stdout`` up to its ``Press Ctrl-C`` line (its start-up banner:
    URLs, the demo ``API key ...``). Fails the test when serve exits first or the line has not come within
    ``timeout_s`` (checked between lines)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = stdout.readline()
        assert line, "serve exited early:\n" + "".join(lines)
        lines.append(line)
        if line.startswith("Press Ctrl-C"):
            return lines
    pytest.fail("serve not ready:\n" + "".join(lines))


def banner_key(lines: list[str]) -> str:
    """The demo API key secret of a serve banner (its ``API key ...`` line)."""
    return next(ln.split()[-1] for ln in lines if ln.startswith("API key"))


def stop_serve(proc: subprocess.Popen) -> None:
    """Stop ``manage.py serve`` as Ctrl-C does (SIGINT); after 60 s, kill its process group."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
