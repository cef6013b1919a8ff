"""Ending a process tree without leaking what multiprocessing's resource tracker cleans up.

A process that uses ``multiprocessing`` (vLLM's engine core and workers do) shares one resource-tracker process with
its parent. The tracker holds the names of the shared-memory segments and semaphores the processes create; when
every holder of its pipe has gone, it unlinks those still registered and exits. SIGKILL of the whole tree, tracker
included, left vLLM's segments in ``/dev/shm`` (``psm_*``, 160-240 MB each, and ``sem.mp-*``) mapped by nobody,
memory lost until a reboot (and a container's 64 MB ``/dev/shm`` full after one). So the tracker is spared: the
others are killed, the tracker is continued (a stopped one could not exit) and left to finish its work.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable

import psutil

# in the tracker's command line (``python -c 'from multiprocessing.resource_tracker import main; main(fd)'``)
RESOURCE_TRACKER_MARK = "multiprocessing.resource_tracker"
TRACKER_EXIT_WAIT_S = 3.0  # how long a spared tracker gets to unlink what it holds and exit before it is killed too


def is_resource_tracker(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a multiprocessing resource tracker (by its command line); False when it is gone."""
    try:
        return any(RESOURCE_TRACKER_MARK in part for part in proc.cmdline())
    except psutil.Error:
        return False


def kill_sparing_trackers(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """SIGKILL every process of ``procs`` that is not a resource tracker and SIGCONT the trackers (module docstring).
    Returns the trackers, for the caller to wait for (``wait_gone``) once every holder of their pipes is dead."""
    trackers = []
    for proc in procs:
        try:
            if is_resource_tracker(proc):
                trackers.append(proc)
                proc.send_signal(signal.SIGCONT)
            else:
                proc.kill()
        except psutil.Error:  # already gone
            pass
    return trackers


def group_members(pgid: int) -> list[psutil.Process]:
    """The processes of process group ``pgid`` now (zombies included)."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return members


def wait_gone(procs: list[psutil.Process], timeout_s: float = TRACKER_EXIT_WAIT_S) -> None:
    """Wait up to ``timeout_s`` for ``procs`` to exit; SIGKILL those still running then."""
    deadline = time.monotonic() + timeout_s
    alive = procs
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _running(p)]
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass


def _running(proc: psutil.Process) -> bool:
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False
