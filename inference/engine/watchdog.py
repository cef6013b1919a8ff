"""The step-loop watchdog of an engine replica: what it takes to call a loop wedged, and how a wedged replica ends.

A replica's heartbeat is a thread of its own (``replica_link.ReplicaLink._heartbeat_loop``), so a step loop stuck in
a call that never returns (a forward pass on a hung device, vLLM's ``LLMEngine.step`` waiting on an engine-core
process that hangs) would keep beating: api processes would go on routing to it and its requests would wait out their
deadlines. The heartbeat thread therefore also watches the loop (``ReplicaLink._give_up_wedged``) and, once it has
not turned over for ``STEP_WATCHDOG_S``, withdraws the replica from the link and ends the process with
``exit_wedged`` for its supervisor (``manage.py serve``, a container's restart policy) to start a fresh one. The
api processes then fail or resend what it held, as for a replica that died (``inference.api.engine_client``). A pause of
the whole process (SIGSTOP, a debugger) holds the heartbeat thread too; once that thread itself went longer than the
heartbeat's TTL without a turn, the watch starts again instead of counting the pause against the loop.

Kept free of torch (stdlib and psutil only), so the engines' command lines can show the defaults without loading it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import traceback

import psutil

from inference.shared.proctree import kill_sparing_trackers
from inference.protocol.engine import HEARTBEAT_TTL_S

# Seconds a step loop may go without turning over. Well past the longest legitimate step: an idle loop turns over
# every ``replica_link.POLL_BLOCK_MS``, a busy one after a step of at most ``max_num_batched_tokens`` tokens; vLLM's
# multiprocess executor allows one model step 300 s (``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``).
STEP_WATCHDOG_S = 300.0
EXIT_STEP_LOOP_WEDGED = 70  # the replica's exit status when its watchdog gives it up (EX_SOFTWARE, sysexits.h)


# The shortest bound that can tell a wedged loop from an idle one: an idle loop's blocking read alone takes
# ``replica_link.POLL_BLOCK_MS`` plus its socket margin, the heartbeat thread checks every ``HEARTBEAT_INTERVAL_S``, and a gap of
# the heartbeat thread longer than the heartbeat's TTL restarts the watch (a paused process). A bound under the TTL
# would end idle replicas.
STEP_WATCHDOG_MIN_S = HEARTBEAT_TTL_S


def check_watchdog_seconds(value: float) -> float:
    """``value`` as a step-watchdog bound in seconds: 0 (off) or a finite number ``>= STEP_WATCHDOG_MIN_S``
    (``-0.0`` reads as 0). Raises ``ValueError`` otherwise: a negative bound, or one under the minimum, would end
    every replica at once, idle or not."""
    if not math.isfinite(value) or value < 0 or 0 < value < STEP_WATCHDOG_MIN_S:
        raise ValueError(f"a step watchdog bound is 0 (off) or seconds >= {STEP_WATCHDOG_MIN_S:g}, got {value!r}")
    return value + 0.0


def watchdog_seconds(text: str) -> float:
    """``argparse`` type of ``--step-watchdog-s``: ``check_watchdog_seconds`` of ``text`` read as a float. Raises
    ``ValueError`` otherwise, which argparse reports as an invalid value."""
    return check_watchdog_seconds(float(text))


def thread_stack(thread_id: int | None) -> str:
    """The current call stack of thread ``thread_id`` as ``traceback.format_stack`` prints it (outermost first),
    or a line saying the thread is gone."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    return "".join(traceback.format_stack(frame)) if frame is not None else "(the thread is gone)\n"


def exit_wedged() -> None:
    """End this process at once with ``EXIT_STEP_LOOP_WEDGED``, from any thread: SIGKILL every descendant first
    (vLLM's engine-core process and its model workers, which a hung core or device would otherwise leave behind as
    orphans holding the device) but multiprocessing's resource tracker, which unlinks their shared memory once this
    process is gone too (``inference.shared.proctree``), flush the root logger's handlers, then ``os._exit`` (the wedged
    thread cannot be joined, so no clean interpreter exit is possible). Never returns."""
    try:
        kill_sparing_trackers(psutil.Process().children(recursive=True))
    except psutil.Error:
        pass
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(EXIT_STEP_LOOP_WEDGED)
