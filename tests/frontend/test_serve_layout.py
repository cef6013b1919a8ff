"""How ``manage.py serve`` shares the cores (ops/layout.py, issue 17): torch threads per CPU engine, the engines'
niceness applied in the child, and layout options refused before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ops.layout import (EngineLayout, engine_layout, engine_threads, render_children, render_processes,
                        render_worker_env)
from ops.supervisor import Supervisor, wait_until
from harness import REPO
from harness.serve import serve_env


@pytest.mark.parametrize("cores,engines,reserved,want", [
    (2, 4, 1, 1),    # the box: four engines on two cores, one kept for the frontend
    (2, 1, 1, 1),
    (16, 1, 1, 15),
    (16, 4, 1, 3),   # (16 - 1) // 4
    (16, 4, 0, 4),
    (8, 0, 1, 7),    # no CPU engine (all on CUDA): the value is unused, still sane
    (1, 3, 1, 1),    # one core: the reservation cannot take the engines' only core
    (4, 2, 9, 1),    # reserving more than there is leaves one core
])
def test_engine_threads_split_what_the_frontend_leaves(cores, engines, reserved, want):
    assert engine_threads(cores, engines, reserved) == want


def test_render_children_split_among_the_render_workers():
    assert render_children(2, 2) == [1, 1]  # serve's default: two processes, one child each
    assert render_children(2, 1) == [2]
    assert render_children(5, 2) == [3, 2]
    assert render_children(2, 3) == [1, 1, 1]  # every process gets a child
    assert render_children(1, 0) == [1]


def test_render_processes_by_pool():
    assert render_processes("prefork", 5, 2) == [3, 2]
    assert render_processes("solo", 2, 2) == [1, 1]  # serve's default: two solo processes
    assert render_processes("solo", 5, 2) == [1, 1, 1, 1, 1]  # one process per render slot
    assert render_processes("solo", 1, 3) == [1, 1, 1]
    with pytest.raises(ValueError):
        render_processes("threads", 2, 2)
    # a solo worker prefetches one task (what it held beyond that would wait while another worker is idle)
    assert render_worker_env("solo", 8) == {"CELERY_REDELIVER_AFTER_S": "8", "CELERY_WORKER_PREFETCH_MULTIPLIER": "1"}
    assert render_worker_env("prefork", 8) == {"CELERY_REDELIVER_AFTER_S": "8"}


def test_engine_layout_takes_the_operators_threads_and_refuses_bad_values():
    assert engine_layout(cores=2, cpu_engines=4, reserved=1, threads=0, nice=10) == EngineLayout(1, 10)
    assert engine_layout(cores=2, cpu_engines=4, reserved=1, threads=2, nice=0) == EngineLayout(2, 0)
    for bad in ({"threads": -1}, {"nice": -1}, {"nice": 20}, {"reserved": -1}):
        kwargs = {"cores": 2, "cpu_engines": 1, "reserved": 1, "threads": 0, "nice": 10, **bad}
        with pytest.raises(ValueError):
            engine_layout(**kwargs)


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[16])


def test_supervisor_starts_and_restarts_a_child_niced(tmp_path):
    sup = Supervisor(env=dict(os.environ), log_dir=tmp_path)
    try:
        base = os.nice(0)
        child = sup.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], nice=7)
        assert _nice(child.proc.pid) == min(19, base + 7)
        plain = sup.start("plain", [sys.executable, "-c", "import time; time.sleep(60)"])
        assert _nice(plain.proc.pid) == base
        child.proc.kill()
        child.proc.wait(timeout=10)
        again = sup.restart(child)
        wait_until(lambda: again.proc.poll() is None, 5, "the restarted child")
        assert _nice(again.proc.pid) == min(19, base + 7)
    finally:
        sup.stop_all(grace_s=5)


@pytest.mark.parametrize("args,message", [(["--engine-nice", "20"], "0..19"), (["--engine-nice", "-2"], "0..19"),
                                          (["--engine-threads", "-1"], "engine threads"),
                                          (["--frontend-reserved-cores", "-1"], "reserved cores"),
                                          (["--engine-unresponsive-s", "-1"], "seconds >= 0"),
                                          (["--engine-step-watchdog-s", "-1"], "seconds >= 3"),
                                          (["--engine-step-watchdog-s", "nan"], "seconds >= 3"),
                                          (["--engine-step-watchdog-s", "0.01"], "seconds >= 3")])
def test_serve_refuses_bad_layout_options_before_starting_anything(tmp_path, args, message):
    out = subprocess.run([sys.executable, str(REPO / "manage.py"), "serve", "--no-engine", *args],
                         env=serve_env(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and message in out.stderr, out.stderr
    assert not (tmp_path / "log").exists()
