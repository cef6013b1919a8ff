"""The supervisor leaves no process behind: a child's own children die with it when it is restarted or stopped,
even when the child itself was killed with SIGKILL (found by a break test: the multimodal api launcher's workers
outlived it)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from ops.supervisor import Supervisor, group_wait_gone, wait_until

# a leader that starts a worker in its process group and then waits, as ops.mm_api does
LEADER = [sys.executable, "-c", "import subprocess, sys, time\n"
          "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
          "print(w.pid, flush=True)\n"
          "time.sleep(120)"]


def _worker_pid(log) -> int:
    wait_until(lambda: log.exists() and log.read_text().strip(), 20, "the worker's pid")
    return int(log.read_text().split()[0])


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_restart_and_stop_kill_what_a_killed_leader_left(tmp_path):
    sup = Supervisor(env=dict(os.environ), log_dir=tmp_path)
    child = sup.start("leader", LEADER)
    try:
        worker = _worker_pid(child.log_path)
        os.kill(child.proc.pid, signal.SIGKILL)
        child.proc.wait(timeout=10)
        assert _alive(worker)  # orphaned, still in the dead leader's group
        child.log_path.write_text("")
        new = sup.restart(child)
        wait_until(lambda: not _alive(worker), 10, "the orphaned worker killed on restart")
        worker = _worker_pid(new.log_path)
        os.kill(new.proc.pid, signal.SIGKILL)
        new.proc.wait(timeout=10)
        time.sleep(0.2)
        assert _alive(worker)
    finally:
        sup.stop_all(grace_s=5)
    wait_until(lambda: not _alive(worker), 10, "the orphaned worker killed on stop")


# a leader whose spawned child (as vLLM starts its engine core) creates a shared-memory segment, registered with
# multiprocessing's resource tracker, prints its name and waits (a file: spawn imports the child's target from it)
SHM_LEADER = """import multiprocessing as mp, time
from multiprocessing import shared_memory


def hold(q):
    shm = shared_memory.SharedMemory(create=True, size=1 << 20)
    q.put(shm.name)
    time.sleep(120)


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ctx.Process(target=hold, args=(q,)).start()
    print(q.get(), flush=True)
    time.sleep(120)
"""


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_kill_group_leaves_no_shared_memory_behind(tmp_path, stopped):
    """SIGKILL of a whole group that uses multiprocessing (a vLLM engine: core, worker, resource tracker) killed the
    tracker too, and the segments it would have unlinked stayed in /dev/shm for good (found by a fresh-eyes check:
    160-240 MB per vLLM restart). ``kill_group`` spares the tracker, which unlinks them once the rest is dead; also
    when the whole group was stopped (SIGSTOP: serve's watch kills such a hung engine)."""
    script = tmp_path / "shm_leader.py"
    script.write_text(SHM_LEADER)
    sup = Supervisor(env=dict(os.environ), log_dir=tmp_path)
    child = sup.start("leader", [sys.executable, str(script)])
    try:
        wait_until(lambda: child.log_path.read_text().strip(), 60, "the segment's name")
        segment = Path("/dev/shm") / child.log_path.read_text().split()[0].lstrip("/")
        assert segment.exists(), segment
        if stopped:
            os.killpg(child.proc.pid, signal.SIGSTOP)
        sup.kill_group(child)
        child.proc.wait(timeout=10)
        assert group_wait_gone(child.proc.pid, 10)
        assert not segment.exists(), f"{segment} left behind"
    finally:
        sup.stop_all(grace_s=5)
