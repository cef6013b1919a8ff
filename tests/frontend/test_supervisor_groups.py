"""The supervisor leaves no process behind: a child's own children die with it when it is restarted or stopped,
even when the child itself was killed with SIGKILL (found by a break test: the multimodal api launcher's workers
outlived it)."""

from __future__ import annotations

import os
import signal
import sys
import time

from ops.supervisor import Supervisor, wait_until

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
