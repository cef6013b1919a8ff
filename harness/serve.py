"""``manage.py serve`` itself, run by a test or a benchmark: its environment, its start-up banner, its process tree, its
stop."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import IO

from harness import REPO
from harness.live_platform import free_port


def serve_env(tmp: Path) -> dict:
    """Environment for a ``manage.py serve`` of a test: ``var/`` in ``tmp``, SQLite there (the README's default), a
    fresh ``LINK_PREFIX``, quiet logs; ``REDIS_URL`` when set, else serve's embedded Redis on a free port."""
    env = dict(os.environ, LLMP_VAR_DIR=str(tmp), LINK_PREFIX=f"sv{uuid.uuid4().hex[:8]}", LOG_LEVEL="WARNING",
               PYTHONPATH=os.pathsep.join([str(REPO / "platform"), str(REPO)]))
    env.pop("DATABASE_URL", None)
    if not env.get("REDIS_URL"):
        env["EMBEDDED_REDIS_PORT"] = str(free_port())
    return env


def serve_redis_url(env: dict, var_dir: Path) -> str:
    """The Redis URL a serve started with ``env`` uses: ``REDIS_URL``, else its embedded server's (the password is
    in ``var/redis_password``; serve's banner hides it)."""
    return env.get("REDIS_URL") or (f"redis://:{(var_dir / 'redis_password').read_text().strip()}"
                                    f"@127.0.0.1:{env['EMBEDDED_REDIS_PORT']}/0")


def child_pids(pid: int) -> list[int]:
    """Process ids whose parent is ``pid``."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def cmdline(pid: int) -> str:
    """``pid``'s command line, arguments joined by spaces; empty once it has exited."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def serve_banner(stdout: IO[str], timeout_s: float) -> list[str]:
    """The lines ``manage.py serve`` printed on ``stdout`` up to its ``Press Ctrl-C`` line (its start-up banner:
    URLs, the demo ``API key ...``). ``AssertionError`` (a failed test) when serve exits first or the line has not
    come within ``timeout_s`` (checked between lines)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = stdout.readline()
        assert line, "serve exited early:\n" + "".join(lines)
        lines.append(line)
        if line.startswith("Press Ctrl-C"):
            return lines
    raise AssertionError("serve not ready:\n" + "".join(lines))


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
