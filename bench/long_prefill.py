"""Benchmark: a long prompt joining 16 running decodes, with chunked prefill off ("before") and on ("after").

The engine's scheduler and runner (``Scheduler.step``, ``ModelRunner``) run in this process on the demo model,
without the Redis link (a step only computes and returns its outputs), so every step can be timed. Per mode:

1. 16 short prompts (20-35 tokens, greedy, ``ignore_eos``) decode; once all have their first token, ``--warm``
   steps are timed: the inter-token gap of the 16 before the join (median over streams and steps);
2. a ``--long``-token prompt joins; the steps until its first token are timed: the largest inter-token gap any
   of the 16 saw meanwhile ("stall");
3. throughput: 16 fresh streams × ``--new-tokens`` tokens, output tokens/s from the first step to the last.

Also times the costliest prefill chunk of ``max_num_batched_tokens - 16`` tokens alone (the long prompt's last one,
attending over all before it), ``max(--warm, 8)`` times (the join takes 9 steps at the defaults): the bound the stall should stay within
is one decode step plus that chunk (issue 20's goal). Both sides are given as median (typical step) and maximum (the
worst step against the worst chunk alone): a maximum of several steps against one best-of chunk timing would count
timer noise as delay. Prints both modes and the ratios before/after in one run.

    .venv/bin/python bench/long_prefill.py [--long 4000] [--streams 16] [--budget 512] [--new-tokens 64] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inference.engine.core import replica_stats
from inference.engine.runner import ModelRunner, make_rng
from inference.engine.sequence import Sequence
from inference.engine.scheduler import Scheduler
from inference.protocol.engine import EngineCoreRequest, SamplingParams


def request(rid: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id=rid, external_req_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                             client_id="bench", arrival_time=time.time())


def scheduler(runner: ModelRunner, args, max_num_seqs: int, chunked: bool) -> Scheduler:
    return Scheduler(runner, "bench", replica_stats("bench", "m", runner.device.type, max_num_seqs),
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=args.budget, enable_chunked_prefill=chunked)


def new_tokens(parts) -> list[str]:
    """The request id of every new token in a step's output parts."""
    return [o.request_id for part in parts for outs in part.values() for o in outs for _ in o.new_token_ids]


def step(core: Scheduler) -> tuple[float, set[str]]:
    """One engine step: (its end time, request ids that got a token in it)."""
    parts = list(core.step())
    t = time.perf_counter()
    return t, set(new_tokens(parts))


def run_mode(runner: ModelRunner, args, chunked: bool, rng: random.Random) -> dict[str, float]:
    runner.reset()
    core = scheduler(runner, args, max(32, args.streams + 1), chunked)
    shorts = [f"s{i}" for i in range(args.streams)]
    for rid in shorts:
        core.accept([request(rid, [rng.randrange(150000) for _ in range(20 + rng.randrange(16))], 10_000)])
    last: dict[str, float] = {}
    while len(last) < len(shorts):
        t, got = step(core)
        last.update({r: t for r in got})
    gaps: list[float] = []
    for _ in range(args.warm):
        t, got = step(core)
        gaps += [t - last[r] for r in got if r in last]
        last.update({r: t for r in got})
    core.accept([request("long", [rng.randrange(150000) for _ in range(args.long)], 1)])
    stall, t_join, steps, join_gaps = 0.0, time.perf_counter(), 0, []
    while True:
        t, got = step(core)
        steps += 1
        step_gaps = [t - last[r] for r in got if r in shorts]
        join_gaps.append(max(step_gaps, default=0.0))
        stall = max([stall] + step_gaps)
        last.update({r: t for r in got})
        if "long" in got:
            break
    t_long = time.perf_counter() - t_join
    core.abort(set(shorts))
    # throughput at ``streams`` concurrent streams
    runner.reset()
    core = scheduler(runner, args, max(32, args.streams), chunked)
    for i in range(args.streams):
        core.accept([request(f"t{i}", [rng.randrange(150000) for _ in range(20 + i)], args.new_tokens)])
    t0, ntok = time.perf_counter(), 0
    while core.num_held:
        ntok += len(new_tokens(core.step()))
    tps = ntok / (time.perf_counter() - t0)
    return {"gap": statistics.median(gaps), "stall": stall, "stall_p50": statistics.median(join_gaps),
            "ttft_long": t_long, "steps": steps, "tps": tps}


def chunk_time(runner: ModelRunner, args, rng: random.Random) -> list[float]:
    """Seconds of the costliest prefill chunk of the long prompt: its last full chunk of ``budget - streams`` tokens
    (it attends over the whole prompt before it), timed alone ``max(--warm, 8)`` times, about as many as the join has
    steps, so its median and maximum compare with the join's like for like."""
    times = []
    n = args.budget - args.streams
    for _ in range(max(args.warm, 8)):
        runner.reset()
        seq = Sequence(request=request("c", [rng.randrange(150000) for _ in range(args.long)], 1), queued_ts=0.0,
                       rng=make_rng(0))
        runner.prepare(seq)
        runner.prefill_chunk(seq, args.long - n)  # one forward up to the last chunk
        t0 = time.perf_counter()
        runner.prefill_chunk(seq, n)
        times.append(time.perf_counter() - t0)
    runner.reset()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=str(ROOT / ".cache/models/tiny-qwen3"))
    ap.add_argument("--long", type=int, default=4000)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="CPU torch threads (1 gives steadier figures on a shared, oversubscribed machine)")
    args = ap.parse_args()
    import torch

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    runner = ModelRunner(args.model_dir, device=args.device, dtype="float32" if args.device == "cpu" else "bfloat16",
                         max_model_len=args.long + 64, prefix_cache_mb=0)
    rng = random.Random(0)
    run_mode(runner, args, True, rng)  # warm-up (allocates the KV buffers at their final size)
    before = run_mode(runner, args, False, rng)
    after = run_mode(runner, args, True, rng)
    chunks = chunk_time(runner, args, rng)
    chunk, chunk_max = statistics.median(chunks), max(chunks)
    print(f"{args.streams} decoding streams, a {args.long}-token prompt joins; max_num_batched_tokens {args.budget}")
    for name, r in (("before (chunked prefill off)", before), ("after  (chunked prefill on) ", after)):
        print(f"{name}: inter-token gap {r['gap'] * 1e3:7.1f} ms, largest gap while the long prompt prefills "
              f"{r['stall'] * 1e3:8.1f} ms ({r['stall'] / r['gap']:5.1f}x), long prompt TTFT {r['ttft_long']:.2f} s "
              f"in {r['steps']} steps; {args.streams} streams {r['tps']:7.1f} tokens/s")
    extra_max, extra_p50 = after["stall"] - after["gap"], after["stall_p50"] - after["gap"]
    print(f"the last {args.budget - args.streams}-token chunk alone ({len(chunks)} times): median "
          f"{chunk * 1e3:.1f} ms, max {chunk_max * 1e3:.1f} ms")
    print(f"after's extra delay per step while the long prompt prefills (its steps' largest gap - the gap before): "
          f"median {extra_p50 * 1e3:.1f} ms = {extra_p50 / chunk:.2f} chunk (median); largest {extra_max * 1e3:.1f} ms "
          f"= {extra_max / chunk_max:.2f} chunk (max) (goal: <= 1 chunk)")
    print(f"ratio largest gap before/after {before['stall'] / after['stall']:.2f}  "
          f"tokens/s after/before {after['tps'] / before['tps']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
