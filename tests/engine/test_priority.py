"""The engine schedules waiting requests by priority (the caller's tier), then arrival (DESIGN.md §12)."""

from __future__ import annotations

from inference.admission import TIER_HIGH, TIER_LOW, engine_priority


def test_waiting_requests_run_by_tier_then_arrival(engine):
    # 8 running requests (max_num_seqs 8) that finish one after another, freeing one slot at a time
    fillers = [engine.send([60 + i, 61 + i, 62 + i], temperature=0, max_tokens=12 + 6 * i, ignore_eos=True)
               for i in range(8)]
    engine.collect(fillers, until_first_token=True)
    # low tier first, then high tier; the high ones must still start first, each tier in arrival order
    low = [engine.send([300 + i] * 5, temperature=0, max_tokens=2, priority=engine_priority(TIER_LOW))
           for i in range(3)]
    high = [engine.send([400 + i] * 5, temperature=0, max_tokens=2, priority=engine_priority(TIER_HIGH, i))
            for i in range(3)]
    got = engine.collect(low + high + fillers, timeout=300)

    def started(rid: str) -> float:
        return next(o.scheduled_ts for o in got[rid] if o.scheduled_ts is not None)

    assert max(started(r) for r in high) < min(started(r) for r in low)
    assert [started(r) for r in high] == sorted(started(r) for r in high)
    assert [started(r) for r in low] == sorted(started(r) for r in low)
