"""CPU seconds spent by a process (``/proc/<pid>/stat``) and what a platform's process is for (its role), for
benchmarks that count every process's CPU."""

from __future__ import annotations

import os

import psutil

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads) from ``/proc/<pid>/stat``; ``None`` when it
    is gone. (Fields 14 and 15, counted after the parenthesised command name, which may hold spaces.)"""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def describe(proc: psutil.Process) -> str:
    """A short name for a server process from its command line: ``celery worker -Q render`` (``... child`` for a
    prefork pool child), ``celery beat``, ``api``, ``api-mm``, ``engine MODEL``, ``redis``; else its own name."""
    argv = proc.cmdline()
    text = " ".join(argv)
    if "celery" in text and "worker" in argv:
        queue = argv[argv.index("-Q") + 1] if "-Q" in argv else "?"
        parent = proc.parent()
        child = parent is not None and "celery" in " ".join(parent.cmdline()) and "worker" in parent.cmdline()
        return f"celery worker -Q {queue}" + (" child" if child else "")
    if "celery" in text and "beat" in argv:
        return "celery beat"
    if "uvicorn" in text:
        return "api"
    if "ops.mm_api" in text:
        return "api-mm"
    if "inference.engine" in text:
        return "engine " + (argv[argv.index("--model") + 1] if "--model" in argv else "?")
    if "redis-server" in text:
        return "redis"
    return proc.name()
