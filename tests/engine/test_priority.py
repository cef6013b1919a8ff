"""The engine schedules waiting requests by priority (the caller's tier, then the tenant's fair rank), then arrival
(docs/ARCHITECTURE.md §3, §5)."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

from inference.api.admission import TIER_HIGH, TIER_LOW, TIER_STANDARD, engine_priority


@contextmanager
def loop_stopped(engine):
    """The engine's process stopped (SIGSTOP) for the block, so its next poll finds everything sent meanwhile at once:
    a filler finishing mid-send would otherwise start whatever had been read by then (seen in loaded CI runs)."""
    os.kill(engine.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(engine.proc.pid, signal.SIGCONT)


def running_fillers(engine, base: int, **send) -> None:
    """8 running requests (max_num_seqs 8) that finish one after another, freeing one slot at a time."""
    fillers = [engine.send([base + i, base + 1 + i, base + 2 + i], temperature=0, max_tokens=12 + 6 * i,
                           ignore_eos=True, **send) for i in range(8)]
    engine.collect(fillers, until_first_token=True)


def start_times(engine, request_ids: list[str]) -> dict[str, float]:
    """When each request was scheduled, once all finished (not the fillers: the first collect may have read past a
    filler's end, which a second one would wait for)."""
    got = engine.collect(request_ids, timeout=300)
    return {rid: next(o.scheduled_ts for o in got[rid] if o.scheduled_ts is not None) for rid in request_ids}


def test_waiting_requests_run_by_tier_then_arrival(engine):
    running_fillers(engine, 60)
    # low tier first, then high tier; the high ones must still start first, each tier in arrival order
    with loop_stopped(engine):
        low = [engine.send([300 + i] * 5, temperature=0, max_tokens=2, priority=engine_priority(TIER_LOW))
               for i in range(3)]
        high = [engine.send([400 + i] * 5, temperature=0, max_tokens=2, priority=engine_priority(TIER_HIGH, i))
                for i in range(3)]
    started = start_times(engine, low + high)
    assert max(started[r] for r in high) < min(started[r] for r in low)
    assert [started[r] for r in high] == sorted(started[r] for r in high)
    assert [started[r] for r in low] == sorted(started[r] for r in low)


def test_routed_backlog_is_read_whole_so_priority_orders_all_of_it(engine):
    """A backlog routed to the replica beyond what it reads of the shared stream (2 × max_num_seqs held) is read
    whole: a request of a tenant within its share (fair rank 0) sent after it still starts before all of it. When the
    engine stopped reading at 2 × max_num_seqs, the rest of the backlog stayed in the Redis stream first come, first
    served, and ran before the later request (issue 18's fairness; DECISIONS D-276)."""
    running_fillers(engine, 70, routed=True)
    # 8 running + 20 over-share requests routed here: more than 2 × max_num_seqs (16) held
    with loop_stopped(engine):
        over = [engine.send([500 + i] * 5, temperature=0, max_tokens=2, routed=True,
                            priority=engine_priority(TIER_STANDARD, fair_rank=3)) for i in range(20)]
        within = [engine.send([600 + i] * 5, temperature=0, max_tokens=2, routed=True,
                              priority=engine_priority(TIER_STANDARD, fair_rank=0)) for i in range(2)]
    started = start_times(engine, over + within)
    assert max(started[r] for r in within) < min(started[r] for r in over)
