"""Tenant-fairness benchmark (issue 18): a well-behaved tenant next to one sending 4× as much, at 1.5× capacity.

Starts the real platform (harness/live_platform.py: Redis, Celery worker+beat, one engine replica of the tiny demo
model, uvicorn) with two tenants' keys (``modest`` and ``greedy``, weight 1 each), then, in one run:

1. measures capacity (closed loop, as bench/admission.py: prompt tokens per second end to end, ``max_tokens=1``)
   and sets ``max_num_queued_tokens = --target-ttft-s × capacity``;
2. ``alone``: the modest tenant alone, open loop at 0.3× capacity (its TTFT baseline);
3. ``fcfs``: both tenants, modest at 0.3× and greedy at 1.2× capacity (1.5× in all; greedy sends 4× modest),
   with fairness off (``fair_share_threshold_pct`` 100: first come, first served at admission and in the engine);
4. ``fair``: the same load with fairness on (``--threshold-pct``, default 50).

Printed per phase and tenant: offered, accepted, refused, refusal rate, p50/p99 TTFT of accepted requests; then
the modest tenant's refusal rate (goal ≤ 5 %) and its p99 TTFT over the ``alone`` p99 (goal ≤ 1.5×), fair vs fcfs.
TTFT is the latency of a ``max_tokens=1`` request. Figures and what bounds them: docs/DECISIONS.md D-202.

    REDIS_URL=redis://127.0.0.1:6379/12 .venv/bin/python bench/fairness.py [--duration 20] [--prompt-len 512]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from bench.lib.completions_load import calibrate, offer
from harness.assets import DEMO_MODEL
from harness.live_platform import start_platform

MODEST_SHARE, GREEDY_SHARE = 0.3, 1.2  # of capacity: 1.5× in all, greedy sends 4× modest


async def both(base: str, modest: str, greedy: str, length: int, cap_rps: float, duration: float) -> tuple[dict, dict]:
    """Both tenants' open loops at once: (modest result, greedy result) as ``bench.lib.completions_load.offer`` gives them."""
    m, g = await asyncio.gather(offer(base, modest, length, MODEST_SHARE * cap_rps, duration),
                                offer(base, greedy, length, GREEDY_SHARE * cap_rps, duration))
    return m, g


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--target-ttft-s", type=float, default=2.0)
    ap.add_argument("--threshold-pct", type=int, default=50, help="fair_share_threshold_pct of the fair phase")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    ap.add_argument("--calib-s", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--engine-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--max-prefill-tokens", type=int, default=None,
                    help="the engine's step token budget (--max-num-batched-tokens; default: the engine's own, 512 on "
                         "the CPU): a request arriving during a step waits for it, so the TTFT a tenant within its "
                         "share can reach is bounded by one step")
    args = ap.parse_args()
    budget = f" --max-num-batched-tokens {args.max_prefill_tokens}" if args.max_prefill_tokens else ""
    os.environ["ENGINE_EXTRA_ARGS"] = (f"{os.environ.get('ENGINE_EXTRA_ARGS', '')} --num-threads {args.engine_threads}"
                                       f"{budget}")
    with tempfile.TemporaryDirectory() as tmp:
        live = start_platform(Path(tmp), max_model_len=max(512, args.prompt_len + 8))
        try:
            base = live.base_url
            modest, greedy = live.new_key(tenant="bench-modest"), live.new_key(tenant="bench-greedy")
            tps = asyncio.run(calibrate(base, modest, args.prompt_len, args.concurrency, args.calib_s))
            cap_rps = tps / args.prompt_len
            limit = max(1, int(args.target_ttft_s * tps))
            print(f"capacity (end to end): {tps:.0f} prompt tokens/s = {cap_rps:.2f} req/s of {args.prompt_len} tokens; "
                  f"max_num_queued_tokens = {limit} (target TTFT {args.target_ttft_s} s)")
            print(f"engine: {args.engine_threads} torch thread(s), step token budget {args.max_prefill_tokens or 'default'}")
            print(f"load: modest {MODEST_SHARE * cap_rps:.2f} req/s, greedy {GREEDY_SHARE * cap_rps:.2f} req/s "
                  f"({(MODEST_SHARE + GREEDY_SHARE):.1f}x capacity), {args.duration:.0f} s per phase")

            def policy(threshold: int) -> None:
                live.manage("admission_policy", DEMO_MODEL, "--max-num-queued-reqs", "none",
                            "--max-num-queued-tokens", str(limit), "--fair-share-threshold-pct", str(threshold))
                time.sleep(1.0)

            rows: list[tuple[str, str, dict]] = []
            policy(args.threshold_pct)
            rows.append(("alone", "modest", asyncio.run(offer(base, modest, args.prompt_len,
                                                               MODEST_SHARE * cap_rps, args.duration))))
            time.sleep(2.0)
            for phase, threshold in (("fcfs", 100), ("fair", args.threshold_pct)):
                policy(threshold)
                m, g = asyncio.run(both(base, modest, greedy, args.prompt_len, cap_rps, args.duration))
                rows += [(phase, "modest", m), (phase, "greedy", g)]
                time.sleep(3.0)
        finally:
            live.stop()
    print()
    print(f"{'phase':<6} {'tenant':<7} {'offered':>7} {'accepted':>8} {'refused':>7} {'refused %':>9} {'other':>5} "
          f"{'p50 TTFT s':>10} {'p99 TTFT s':>10}")
    by = {}
    for phase, tenant, r in rows:
        rate = r["refused"] / max(1, r["offered"])
        by[(phase, tenant)] = (rate, r)
        print(f"{phase:<6} {tenant:<7} {r['offered']:>7} {r['accepted']:>8} {r['refused']:>7} {rate * 100:>8.1f}% "
              f"{r['other']:>5} {r['p50']:>10.2f} {r['p99']:>10.2f}")
    alone_p99 = by[("alone", "modest")][1]["p99"]
    print()
    for phase in ("fcfs", "fair"):
        rate, r = by[(phase, "modest")]
        print(f"{phase}: modest refusal rate {rate * 100:.1f} % (goal <= 5 %), p99 TTFT / alone = "
              f"{r['p99'] / alone_p99:.2f} (goal <= 1.5); greedy accepted {by[(phase, 'greedy')][1]['accepted']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
