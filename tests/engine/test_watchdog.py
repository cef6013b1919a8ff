"""The step-loop watchdog (``inference/engine/watchdog.py``): a replica whose step loop is wedged in a call that
never returns withdraws from the link and exits, instead of heart-beating on while its requests wait forever.

The wedge is a real one: vLLM's engine-core process is stopped (SIGSTOP), as a hung core or device would leave it,
so the replica's ``LLMEngine.step`` waits on it for good while the replica's heartbeat thread runs on. The same
replica first shows that a loop that idles longer than the bound, and one that serves a request, is not given up.
The watchdog is the replica link's (``ReplicaLink``), the same code on the native backend, whose shared test engine
runs every engine test with a 30 s bound (``conftest.engine``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from inference.engine.watchdog import EXIT_STEP_LOOP_WEDGED
from inference.protocol.engine import replicas_index_key
from tests.engine.conftest import MODEL, EngineProc

WATCHDOG_S = 3.0
PROMPT = [9707, 11, 1879, 0, 3555, 374, 279, 6722, 315, 9625, 30]


def children_of(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (read from ``/proc``)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def descendants_of(pid: int) -> list[int]:
    """Process ids below ``pid`` in the process tree, nearest first."""
    found, frontier = [], [pid]
    while frontier:
        kids = [c for p in frontier for c in children_of(p)]
        found += kids
        frontier = kids
    return found


def shm_segments() -> set[str]:
    """Names of multiprocessing's shared-memory segments and semaphores in /dev/shm (``psm_*``, ``sem.mp-*``)."""
    return {p.name for p in Path("/dev/shm").glob("*") if p.name.startswith(("psm_", "sem.mp-"))}


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (no longer exists, or is a zombie waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


@pytest.mark.parametrize("backend", ["vllm"], indirect=True)
def test_wedged_step_loop_withdraws_and_exits(backend, redis_url, link_prefix, model_dir, tmp_path):
    log = tmp_path / "engine.log"
    shm_before = shm_segments()
    eng = EngineProc(redis_url, f"{link_prefix}wd", model_dir, log, "--step-watchdog-s", str(WATCHDOG_S),
                     backend=backend)
    index = replicas_index_key(eng.prefix, MODEL)
    core_pids: list[int] = []
    tree: list[int] = []
    try:
        # an idle loop turns over every poll: idling past the bound does not give the replica up
        time.sleep(WATCHDOG_S + 1.5)
        assert eng.proc.poll() is None and eng.stats() is not None, log.read_text()[-3000:]
        rid = eng.send(PROMPT, temperature=0.0, max_tokens=8, ignore_eos=True)
        assert len([t for o in eng.collect([rid])[rid] for t in o.new_token_ids]) == 8

        # long enough that it is still generating when its core is stopped: 400 tokens could end first on a fast CPU
        # (the replica's loop then idles and never waits on the stopped core)
        rid = eng.send(PROMPT, temperature=1.0, max_tokens=3000, ignore_eos=True)
        first = eng.collect([rid], until_first_token=True)
        assert not any(o.finish_reason for o in first[rid]), first
        tree = descendants_of(eng.proc.pid)  # vLLM's engine core, its model worker, multiprocessing's tracker
        core_pids = [p for p in tree if Path(f"/proc/{p}/comm").read_text().startswith("VLLM::EngineCor")]
        assert len(core_pids) == 1, {p: Path(f"/proc/{p}/cmdline").read_text() for p in tree}
        stopped_at = time.monotonic()
        os.kill(core_pids[0], signal.SIGSTOP)  # the core hangs: the replica's LLMEngine.step waits on it for good

        assert eng.proc.wait(timeout=60) == EXIT_STEP_LOOP_WEDGED, log.read_text()[-3000:]
        took = time.monotonic() - stopped_at
        text = log.read_text()
        assert "the step loop has not turned over" in text and "wedged" in text, text[-3000:]
        assert "def step" in text or "in step" in text, text[-3000:]  # the loop's stack shows where it hung
        assert took >= WATCHDOG_S - 0.5, took  # not before the bound (less the step it was in when stopped)
        # withdrawn: api processes see it gone at once; expired (not removed) in the index for a live replica to
        # take over its unread requests
        assert not eng.r.exists(eng.hb_key)
        assert eng.r.zscore(index, eng.engine_id) < time.time() * 1000
        # neither the hung core nor the worker below it outlived their replica as orphans
        deadline = time.monotonic() + 10
        while not all(gone(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(gone(pid) for pid in tree), {p: Path(f"/proc/{p}/cmdline").read_text() for p in tree if not gone(p)}
        # and vLLM's shared memory went with them: the resource tracker, spared, unlinked it (inference/shared/proctree.py)
        deadline = time.monotonic() + 10
        while shm_segments() - shm_before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not shm_segments() - shm_before, shm_segments() - shm_before
    finally:
        for pid in core_pids:  # a failed check must not leave a stopped process behind
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        eng.stop(timeout=5)
        keys = list(eng.r.scan_iter(f"{eng.prefix}:*", count=1000))
        if keys:
            eng.r.delete(*keys)


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "x", "0.01", "2.9"])
def test_the_bound_must_be_seconds_zero_or_more(value):
    """A negative bound would end a replica at its first heartbeat, one under the heartbeat's TTL an idle replica
    (its blocking read alone takes 0.1 s and more); both engines' command lines refuse them (and what is not a
    finite number), as they take 0 (or -0) for off."""
    from inference.engine.__main__ import parse_args
    from inference.engine.vllm_backend.__main__ import parse_args as parse_vllm_args

    base = ["--model", MODEL, "--model-dir", "d"]
    for parse in (parse_args, parse_vllm_args):
        with pytest.raises(SystemExit):
            parse([*base, "--step-watchdog-s", value])
        assert parse([*base, "--step-watchdog-s", "0"]).step_watchdog_s == 0
        assert str(parse([*base, "--step-watchdog-s", "-0"]).step_watchdog_s) == "0.0"
        assert parse([*base, "--step-watchdog-s", "3"]).step_watchdog_s == 3
        assert parse(base).step_watchdog_s == 300
