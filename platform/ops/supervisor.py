"""Start, watch and stop the platform's processes on one machine (docs/ARCHITECTURE.md §1).

``Supervisor`` launches children (embedded Redis, Celery worker and beat, engine replicas, uvicorn) in
their own process groups, each optionally pinned to CPUs and at a lower CPU priority, restarts one in its
place on request, and on Ctrl-C / SIGTERM stops them in reverse order (SIGTERM, then SIGKILL after a grace
period). Which children are restarted and how often is the caller's policy (``RestartPolicy``; ``manage.py
serve`` restarts every child but Redis, and stops everything when one keeps crashing).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from inference.shared.proctree import group_members, kill_sparing_trackers, wait_gone


GROUP_EXIT_WAIT_S = 5.0  # how long a restart waits for the old process group to be gone


def group_wait_gone(pgid: int, timeout_s: float) -> bool:
    """Wait until no process is left in process group ``pgid`` (polling every 20 ms); False after ``timeout_s``
    (e.g. a member that is a zombie nobody reaps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    env_extra: dict[str, str] = field(default_factory=dict)
    cpus: frozenset[int] | None = None
    nice: int = 0


def _child_setup(cpus: frozenset[int] | None, nice: int):
    """The ``preexec_fn`` that pins the child to ``cpus`` and lowers its priority by ``nice``, or ``None``."""
    if not cpus and not nice:
        return None

    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        if nice:
            os.nice(nice)
    return setup


@dataclass
class RestartPolicy:
    """Restart a crashed child at most ``max_restarts`` times per ``window_s`` seconds, else give up."""

    max_restarts: int = 5
    window_s: float = 60.0
    history: dict[str, list[float]] = field(default_factory=dict)

    def allow(self, name: str, now: float) -> bool:
        """Record a restart of ``name`` at ``now`` if the budget allows it."""
        recent = [t for t in self.history.get(name, []) if now - t < self.window_s]
        if len(recent) >= self.max_restarts:
            return False
        self.history[name] = recent + [now]
        return True


@dataclass
class Supervisor:
    """Owns the child processes; ``stop_all`` is idempotent."""

    env: dict[str, str]
    log_dir: Path
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str], *, stdout_to_console: bool = False,
              env_extra: dict[str, str] | None = None, cpus: frozenset[int] | None = None,
              nice: int = 0) -> Child:
        """Start ``argv`` as child ``name``; output goes to ``log_dir/<name>.log`` (or the console).
        ``env_extra``: variables added to ``env`` for this child only. ``cpus``: CPU numbers the child (and every
        thread and process it starts) may run on, set before it executes anything (``sched_setaffinity``).
        ``nice``: niceness added to the child's (``os.nice``, inherited by its threads and processes; 0..19)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        child = Child(name=name, argv=argv, log_path=self.log_dir / f"{name}.log", env_extra=dict(env_extra or {}),
                      cpus=cpus, nice=nice)
        out = None if stdout_to_console else open(child.log_path, "ab")
        child.proc = subprocess.Popen(argv, env={**self.env, **child.env_extra}, stdout=out,
                                      stderr=subprocess.STDOUT if out else None, stdin=subprocess.DEVNULL,
                                      start_new_session=True, preexec_fn=_child_setup(cpus, nice))
        if out is not None:
            out.close()  # the child holds its own copy
        self.children.append(child)
        return child

    def dead_child(self) -> Child | None:
        """The first child that has exited, if any."""
        for child in self.children:
            if child.proc is not None and child.proc.poll() is not None:
                return child
        return None

    def restart(self, child: Child) -> Child:
        """Start ``child``'s command again in its place (same name, same log file), after killing what is left of
        the old one's process group (workers its leader started outlive a leader killed with SIGKILL) and waiting,
        at most ``GROUP_EXIT_WAIT_S``, for them to be gone: an api's uvicorn workers hold its listening socket, and
        the new api could not bind the port while they do."""
        self.kill_group(child)
        if child.proc is not None:
            group_wait_gone(child.proc.pid, GROUP_EXIT_WAIT_S)
        self.children.remove(child)
        return self.start(child.name, child.argv, env_extra=child.env_extra, cpus=child.cpus, nice=child.nice)

    @staticmethod
    def kill_group(child: Child) -> None:
        """SIGKILL every process left in ``child``'s process group (its own session, so nothing else). A
        multiprocessing resource tracker among them (a vLLM engine's) is continued and given up to
        ``TRACKER_EXIT_WAIT_S`` to unlink the shared memory the killed ones left and exit (``inference.shared.proctree``:
        killed with the rest it leaked vLLM's ``/dev/shm`` segments at every restart)."""
        if child.proc is not None:
            pgid = child.proc.pid
            wait_gone(kill_sparing_trackers(group_members(pgid)))
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child (newest first), wait up to ``grace_s``, then SIGKILL the rest."""
        for child in reversed(self.children):
            if child.proc:  # also when the leader has exited: processes it started may still be in its group
                try:
                    os.killpg(child.proc.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + grace_s
        for child in reversed(self.children):
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(child.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                child.proc.wait()
        for child in self.children:
            self.kill_group(child)  # stragglers whose leader has exited
        self.children.clear()


def wait_until(predicate, timeout_s: float, what: str, supervisor: Supervisor | None = None) -> None:
    """Poll ``predicate`` every 0.2 s until true; raise ``RuntimeError`` after ``timeout_s`` or if a child died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if supervisor is not None:
            dead = supervisor.dead_child()
            if dead is not None:
                raise RuntimeError(f"{dead.name} exited with code {dead.proc.returncode} while waiting for {what}; "
                                   f"see {dead.log_path}")
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPU numbers from a list such as ``0``, ``0,2`` or ``0-3,6`` (the ``taskset -c`` syntax). Raises
    ``ValueError`` on anything else or an empty list."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (expected e.g. 0 or 0,2 or 0-3)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"not a CPU list: {text!r} ({part} is an empty range)")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def unix_socket_accepts(path: str) -> bool:
    """True when a connection to the unix socket at ``path`` succeeds."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(0.5)
            s.connect(path)
            return True
    except OSError:
        return False


def port_open(host: str, port: int) -> bool:
    """True when a TCP connection to ``host:port`` succeeds."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def http_ok(url: str) -> bool:
    """True when a GET of ``url`` answers 200 within 1 s (anything else, errors included: False)."""
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except Exception:  # noqa: BLE001
        return False


def redis_ping(client) -> bool:
    """True when the redis-py ``client`` answers ``PING`` (any error: False)."""
    try:
        return bool(client.ping())
    except Exception:  # noqa: BLE001
        return False


def python() -> str:
    """The interpreter running this process (children use the same virtual environment)."""
    return sys.executable
