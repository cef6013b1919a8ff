"""The multimodal api launcher never waits without bound on a worker it told to stop (found by CI: once, the survivor
of a killed worker had not exited 30 s after its SIGTERM, and nothing showed where it was). ``stop_within`` dumps a
straggler's stacks and kills it; a worker that exits on its own is only joined."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import time

from ops.mm_api import stop_within
from ops.supervisor import wait_until


def stuck_in_here(dump_path: str) -> None:
    """A worker that ignores SIGTERM and would sleep for a minute; SIGUSR2 writes its stacks to ``dump_path``."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR2, file=open(dump_path, "w"), all_threads=True)
    open(dump_path + ".ready", "w").close()
    time.sleep(60)


def polite() -> None:
    time.sleep(60)


def test_a_worker_that_ignores_sigterm_is_dumped_then_killed_in_bounded_time(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    dump = tmp_path / "stacks.txt"
    stuck, fine = ctx.Process(target=stuck_in_here, args=(str(dump),)), ctx.Process(target=polite)
    stuck.start()
    fine.start()
    wait_until(lambda: os.path.exists(f"{dump}.ready"), 60, "the stuck worker's handlers")
    for p in (stuck, fine):
        os.kill(p.pid, signal.SIGTERM)
    t0 = time.monotonic()
    stop_within([stuck, fine], 1.5)
    took = time.monotonic() - t0
    assert 1.4 < took < 10, took
    assert stuck.exitcode == -signal.SIGKILL and fine.exitcode == -signal.SIGTERM
    assert "stuck_in_here" in dump.read_text()


def test_workers_that_exit_are_only_joined():
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=polite) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        os.kill(p.pid, signal.SIGTERM)
    t0 = time.monotonic()
    stop_within(procs, 30)
    assert time.monotonic() - t0 < 5
    assert [p.exitcode for p in procs] == [-signal.SIGTERM, -signal.SIGTERM]
