"""Benchmark: prefix-aware routing (ENGINE_ROUTING=prefix) against the shared stream (any replica pulls), 2 replicas.

Starts two ``python -m inference.engine`` replicas of the demo model (``--num-threads 1`` each) and drives them
through the api's own engine link (``inference.api.engine_client.EngineLink``, the code every api process sends with),
switching its ``routing`` between runs in the same process:

* ``multi-turn``: ``--conversations`` concurrent conversations, each over one of ``--systems`` shared system
  prompts (``--system-tokens`` long); each turn appends the previous answer and a new user message
  (``--turn-tokens`` ± 50 %) and is sent when the previous one finished (closed loop); a conversation whose next
  prompt would pass ``--max-model-len`` starts over from its system prompt. ``--turns`` turns per conversation.
* ``no-shared-prefix``: the same number of single prompts of random tokens (lengths like the multi-turn prompts),
  the same concurrency: nothing to reuse, routing can only balance load.

Each run draws fresh token ids (no run reuses another's cache). Prints per run: TTFT p50/p99, prompt tokens served
per second of wall time, the share of prompt tokens read from the prefix cache, and the ratios routing / shared.

    python bench/routing.py [--conversations 12] [--turns 8] [--systems 3] [--system-tokens 400]
        [--turn-tokens 160] [--max-tokens 8] [--max-model-len 2048] [--rounds 1] [--prefix-cache-mb MB]
        [--redis-url redis://127.0.0.1:6379/3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inference.api.engine_client import ROUTING_PREFIX, ROUTING_SHARED, EngineLink
from inference.api.router import request_cost_tokens
from inference.protocol.engine import EngineCoreRequest, SamplingParams, replica_key

MODEL = "m"


@dataclass
class RunResult:
    """Figures of one run."""

    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    wall_s: float = 0.0
    errors: int = 0

    def p(self, q: float) -> float:
        xs = sorted(self.ttft)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.prompt_tokens / self.wall_s if self.wall_s else 0.0


async def one_request(link: EngineLink, prompt: list[int], max_tokens: int, res: RunResult) -> list[int]:
    """Send one request, wait for its end; record TTFT and cached tokens. Returns the output ids."""
    rid = f"b-{uuid.uuid4().hex[:12]}"
    req = EngineCoreRequest(request_id=rid, external_req_id=rid, prompt_token_ids=prompt,
                            sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            client_id=link.client_id, arrival_time=time.time())
    t0 = time.perf_counter()
    queues = await link.add_requests(MODEL, [req])
    q = queues[rid]
    out: list[int] = []
    first = None
    try:
        while True:
            o = await asyncio.wait_for(q.get(), 120)
            if o.new_token_ids and first is None:
                first = time.perf_counter() - t0
                res.cached_tokens += o.num_cached_tokens
            out += o.new_token_ids
            if o.finish_reason is not None:
                if o.error:
                    res.errors += 1
                break
    finally:
        link.release(rid)
    if first is not None:
        res.ttft.append(first)
        res.prompt_tokens += len(prompt)
    return out


async def multi_turn(link: EngineLink, args, rng: random.Random) -> RunResult:
    res = RunResult()
    systems = [[rng.randrange(1000, 100_000) for _ in range(args.system_tokens)] for _ in range(args.systems)]

    def user_turn() -> list[int]:
        n = rng.randint(args.turn_tokens // 2, args.turn_tokens * 3 // 2)
        return [rng.randrange(1000, 100_000) for _ in range(n)]

    async def conversation(i: int) -> None:
        history = list(systems[i % len(systems)])
        for _ in range(args.turns):
            turn = user_turn()
            if len(history) + len(turn) + args.max_tokens > args.max_model_len:
                history = list(systems[i % len(systems)])
            history += turn
            history += await one_request(link, list(history), args.max_tokens, res)

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(i) for i in range(args.conversations)))
    res.wall_s = time.perf_counter() - t0
    return res


async def no_shared_prefix(link: EngineLink, args, rng: random.Random) -> RunResult:
    res = RunResult()
    hi = args.max_model_len - args.max_tokens

    async def client(i: int) -> None:
        for k in range(args.turns):
            # lengths like the multi-turn prompts: they grow over a conversation's turns
            n = min(hi, args.system_tokens + (k + 1) * args.turn_tokens + rng.randint(-50, 50))
            await one_request(link, [rng.randrange(1000, 100_000) for _ in range(n)], args.max_tokens, res)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(args.conversations)))
    res.wall_s = time.perf_counter() - t0
    return res


def start_engines(args, prefix: str) -> list[subprocess.Popen]:
    r = redis.Redis.from_url(args.redis_url)
    procs = []
    for eid in ("r1", "r2"):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "inference.engine", "--model", MODEL, "--model-dir", args.model_dir,
             "--redis-url", args.redis_url, "--link-prefix", prefix, "--engine-id", eid, "--num-threads", "1",
             "--max-model-len", str(args.max_model_len), "--log-level", "WARNING",
             *(("--prefix-cache-mb", str(args.prefix_cache_mb)) if args.prefix_cache_mb is not None else ())],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT))))
    deadline = time.time() + 300
    while not all(r.exists(replica_key(prefix, MODEL, e)) for e in ("r1", "r2")):
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError("engines did not start")
        time.sleep(0.2)
    return procs


def line(name: str, mode: str, res: RunResult) -> str:
    share = res.cached_tokens / res.prompt_tokens if res.prompt_tokens else 0.0
    return (f"{name:17s} {mode:7s} n={len(res.ttft):4d} err={res.errors} TTFT p50={res.p(0.5) * 1000:7.1f} ms "
            f"p99={res.p(0.99) * 1000:7.1f} ms  prompt tok/s={res.tokens_per_s:8.0f}  cached={share:5.1%}  "
            f"wall={res.wall_s:5.1f} s")


async def run(args, prefix: str) -> None:
    link = EngineLink.for_current_process(args.redis_url, prefix)
    rng = random.Random(args.seed)
    try:
        # warm-up: the first forwards of each replica are slower
        link.routing = ROUTING_PREFIX
        await asyncio.gather(*(one_request(link, [rng.randrange(1000, 100_000) for _ in range(300)], 2, RunResult())
                               for _ in range(4)))
        results: dict[tuple[str, str], list[RunResult]] = {}
        costs: list[float | None] = [None if c == "auto" else float(c) for c in args.request_costs.split(",")]
        modes = [(ROUTING_SHARED, None)] + [(ROUTING_PREFIX, c) for c in costs]
        workloads = [w for w in (("multi-turn", multi_turn), ("no-shared-prefix", no_shared_prefix))
                     if args.workload in ("both", w[0])]
        for _ in range(args.rounds):
            for name, fn in workloads:
                for mode, cost in modes:
                    link.routing, link.request_cost_tokens = mode, cost
                    label = mode if cost is None else f"{mode}@{cost:g}"
                    res = await fn(link, args, random.Random(rng.random()))
                    results.setdefault((name, label), []).append(res)
                    print(line(name, label, res), flush=True)
        stats = await link.live_replicas(MODEL)
        print("replicas' measured throughputs: " + ", ".join(
            f"{st.engine_id} prefill {st.prefill_tokens_per_s:.0f} tok/s decode {st.decode_tokens_per_s:.0f} tok/s"
            for st in stats) + "; router request weight "
            f"{request_cost_tokens([(st.prefill_tokens_per_s, st.decode_tokens_per_s) for st in stats]):.0f} tokens")
        print("\nratios shared / routing (> 1: routing better), medians over rounds:")
        for (name, label), ro in results.items():
            if label == ROUTING_SHARED:
                continue
            sh = results[(name, ROUTING_SHARED)]
            p50 = statistics.median(s.p(0.5) / r.p(0.5) for s, r in zip(sh, ro))
            p99 = statistics.median(s.p(0.99) / r.p(0.99) for s, r in zip(sh, ro))
            tps = statistics.median(r.tokens_per_s / s.tokens_per_s for s, r in zip(sh, ro))
            print(f"{name:17s} {label:11s} TTFT p50 {p50:5.2f}x  p99 {p99:5.2f}x  "
                  f"prompt tokens/s (routing/shared) {tps:5.2f}x")
    finally:
        await link.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=str(ROOT / ".cache/models/tiny-qwen3"))
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/3")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--systems", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--turn-tokens", type=int, default=160)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--prefix-cache-mb", type=float, default=None,
                    help="each replica's prefix cache (MiB; the engine's default when omitted, which holds this whole "
                         "workload): a cache smaller than the conversations' working set is the case a GPU fleet "
                         "lives in (the demo model's K/V is 1 KiB per token in float32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workload", choices=["both", "multi-turn", "no-shared-prefix"], default="both")
    ap.add_argument("--request-costs", default="auto",
                    help="comma-separated router request weights (tokens) to compare; auto (default): the router's "
                         "own, from the replicas' measured throughputs")
    args = ap.parse_args()
    prefix = f"br{uuid.uuid4().hex[:6]}"
    procs = start_engines(args, prefix)
    try:
        asyncio.run(run(args, prefix))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        r = redis.Redis.from_url(args.redis_url)
        keys = list(r.scan_iter(f"{prefix}:*", count=1000))
        if keys:
            r.delete(*keys)
    return 0


if __name__ == "__main__":
    sys.exit(main())
