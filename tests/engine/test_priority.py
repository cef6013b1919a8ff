"""The engine schedules waiting requests by priority (the caller's tier, then the tenant's fair rank), then arrival
(DESIGN.md §12)."""

from __future__ import annotations

import os
import signal

from inference.admission import TIER_HIGH, TIER_LOW, TIER_STANDARD, engine_priority


def test_waiting_requests_run_by_tier_then_arrival(engine):
    # 8 running requests (max_num_seqs 8) that finish one after another, freeing one slot at a time
    fillers = [engine.send([60 + i, 61 + i, 62 + i], temperature=0, max_tokens=12 + 6 * i, ignore_eos=True)
               for i in range(8)]
    engine.collect(fillers, until_first_token=True)
    # low tier first, then high tier; the high ones must still start first, each tier in arrival order. The engine's
    # loop is stopped while they are sent (a filler finishing meanwhile would start a low one before the high ones
    # exist: seen once under a loaded CI run on the vLLM backend)
    os.kill(engine.proc.pid, signal.SIGSTOP)
    try:
        low = [engine.send([300 + i] * 5, temperature=0, max_tokens=2, priority=engine_priority(TIER_LOW))
               for i in range(3)]
        high = [engine.send([400 + i] * 5, temperature=0, max_tokens=2, priority=engine_priority(TIER_HIGH, i))
                for i in range(3)]
    finally:
        os.kill(engine.proc.pid, signal.SIGCONT)
    # (not the fillers: the first collect may have read past a filler's end, which a second one would wait for)
    got = engine.collect(low + high, timeout=300)

    def started(rid: str) -> float:
        return next(o.scheduled_ts for o in got[rid] if o.scheduled_ts is not None)

    assert max(started(r) for r in high) < min(started(r) for r in low)
    assert [started(r) for r in high] == sorted(started(r) for r in high)
    assert [started(r) for r in low] == sorted(started(r) for r in low)


def test_routed_backlog_is_read_whole_so_priority_orders_all_of_it(engine):
    """A backlog routed to the replica beyond what it reads of the shared stream (2 × max_num_seqs held) is read
    whole: a request of a tenant within its share (fair rank 0) sent after it still starts before all of it. When the
    engine stopped reading at 2 × max_num_seqs, the rest of the backlog stayed in the Redis stream first come, first
    served, and ran before the later request (issue 18's fairness; DECISIONS D-276)."""
    fillers = [engine.send([70 + i, 71 + i, 72 + i], temperature=0, max_tokens=12 + 6 * i, ignore_eos=True,
                           routed=True) for i in range(8)]
    engine.collect(fillers, until_first_token=True)
    # 8 running + 20 over-share requests routed here: more than 2 × max_num_seqs (16) held. The engine's loop is
    # stopped while they are sent (a filler finishing meanwhile would start whatever had been read by then), so its
    # next poll finds all 22 in its stream
    os.kill(engine.proc.pid, signal.SIGSTOP)
    try:
        over = [engine.send([500 + i] * 5, temperature=0, max_tokens=2, routed=True,
                            priority=engine_priority(TIER_STANDARD, fair_rank=3)) for i in range(20)]
        within = [engine.send([600 + i] * 5, temperature=0, max_tokens=2, routed=True,
                              priority=engine_priority(TIER_STANDARD, fair_rank=0)) for i in range(2)]
    finally:
        os.kill(engine.proc.pid, signal.SIGCONT)
    # (not the fillers: the first collect may have read past a filler's end, which a second one would wait for)
    got = engine.collect(over + within, timeout=300)

    def started(rid: str) -> float:
        return next(o.scheduled_ts for o in got[rid] if o.scheduled_ts is not None)

    assert max(started(r) for r in within) < min(started(r) for r in over)
