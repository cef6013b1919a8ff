"""A CPU engine started without ``--num-threads`` runs as many torch threads as the CPUs it may use
(``inference.engine.__main__.default_num_threads``), not the host's count: a process pinned to one CPU (its
affinity, what a cpuset or ``taskset`` gives) or capped by ``LOKY_MAX_CPU_COUNT`` gets that many."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = "from inference.engine.__main__ import default_num_threads; print(default_num_threads())"


def _threads(env: dict[str, str] | None = None, cpus: set[int] | None = None) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**os.environ, **(env or {})},
                         preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
                         capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout.strip())


def test_default_threads_follow_the_cpus_the_process_may_use() -> None:
    usable = sorted(os.sched_getaffinity(0))
    assert _threads() == len(usable)
    assert _threads(cpus={usable[0]}) == 1  # pinned to one CPU: one thread, whatever the host has
    assert _threads(env={"LOKY_MAX_CPU_COUNT": "1"}) == 1
