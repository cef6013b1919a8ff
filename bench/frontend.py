"""Frontend cost: ``POST /tokenize`` (chat body) on this platform vs vLLM's CPU server, in one run.

What it measures: validate + chat template + tokenize + JSON, no engine work. Both servers serve the
same Qwen3 tokenizer (the demo model ``.cache/models/tiny-qwen3``). Bodies: a chat of about 1,000 and one
of about 8,000 tokens (multi-turn, checked with our own /tokenize), each request with its own number at the end of
its last message (distinct bodies: issue 19's rule). Concurrency 1 and 32. Our side runs
twice: the default rendering route (``RENDER_ROUTE=celery``: Celery ``render`` queue, 2 solo workers)
and the in-process route (``RENDER_ROUTE=inline``: thread pool in the api process). One uvicorn process
per side; vLLM runs its single api server.

Usage::

    .venv/bin/python bench/frontend.py [--requests 200] [--vllm-python .peer/vllm/bin/python] [--no-vllm] [--render-pool solo|prefork]

Needs Redis (``REDIS_URL``, e.g. redis://127.0.0.1:6379/13) or starts the embedded one, and vLLM installed
by ``scripts/setup.sh --vllm`` (``.peer/vllm``). Prints p50/p99 latency (ms), requests/s and the
ratios ours/vLLM (latency: lower is better, so a ratio < 1 means we are faster; throughput: > 1 means we
are faster). Both servers are checked to return identical token ids first.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from bench.lib.tokenize_bodies import chat_body, first_tokens
from bench.lib.vllm_server import start_vllm, stop_vllm
from harness.live_platform import free_port, start_platform


def numbered(body: dict, i: int) -> dict:
    """``body`` with request number ``i`` at the end of its last message: every request differs, so no cache of whole
    messages or prompts serves a repeat (issue 19's rule; earlier messages still repeat, as a conversation's do)."""
    msgs = [dict(m) for m in body["messages"]]
    msgs[-1]["content"] = f"{msgs[-1]['content']} (request {i})"
    return {**body, "messages": msgs}


async def run_load(url: str, headers: dict, body: dict, concurrency: int, total: int) -> dict:
    """``total`` requests with ``concurrency`` in flight, each ``body`` with its own number (``numbered``); returns
    latencies (s) and wall time."""
    lat: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits, headers=headers) as client:
        for w in range(min(4, total)):  # warm-up (tokenizer load, connections)
            await client.post(url, json=numbered(body, -1 - w))
        bodies = [numbered(body, i) for i in range(total)]  # built before the clock starts
        queue = list(range(total))

        async def worker():
            nonlocal errors
            while queue:
                i = queue.pop()
                t0 = time.perf_counter()
                resp = await client.post(url, json=bodies[i])
                lat.append(time.perf_counter() - t0)
                if resp.status_code != 200:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    lat.sort()
    return {"p50": statistics.median(lat) * 1000, "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
            "rps": total / wall, "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per cell (concurrency 1 uses a quarter)")
    ap.add_argument("--render-pool", choices=("solo", "prefork"), default="solo",
                    help="the render workers' Celery pool: solo (two workers, serve's default) or prefork (one worker, "
                         "two children; DECISIONS D-296)")
    ap.add_argument("--vllm-python", default=str(REPO / ".peer" / "vllm" / "bin" / "python"))
    ap.add_argument("--no-vllm", action="store_true",
                    help="our two routes only; ratios against ours/inline (the render hop's cost, no vLLM to start)")
    args = ap.parse_args()
    base = "ours/inline" if args.no_vllm else "vllm"

    tmp = Path(tempfile.mkdtemp(prefix="bench-frontend-"))
    live = start_platform(tmp, max_model_len=4096, engine=False, render_pool=args.render_pool)
    vllm = None
    try:
        inline_url = live.start_inline_api()
        targets = {
            "ours/celery": (live.base_url, {"Authorization": f"Bearer {live.api_key}"}),
            "ours/inline": (inline_url, {"Authorization": f"Bearer {live.api_key}"}),
        }
        if not args.no_vllm:
            vport = free_port()
            vllm = start_vllm(args.vllm_python, vport, tmp / "vllm.log")
            targets["vllm"] = (f"http://127.0.0.1:{vport}", {})
        bodies = {}
        for size in (1000, 8000):
            body = {"model": "tiny-qwen3", **chat_body(size)}
            ids = {name: first_tokens(url, h, body) for name, (url, h) in targets.items()}
            assert len({tuple(v) for v in ids.values()}) == 1, "token ids differ between servers"
            bodies[size] = (body, len(ids[base]))
        rows = []
        for _size, (body, ntok) in bodies.items():
            for conc in (1, 32):
                total = args.requests if conc > 1 else max(20, args.requests // 4)
                res = {name: asyncio.run(run_load(url + "/tokenize", h, body, conc, total))
                       for name, (url, h) in targets.items()}
                rows.append((ntok, conc, res))
        print(f"\n/tokenize chat body, Qwen3 tokenizer; {os.cpu_count()} CPUs shared by both servers\n")
        label = "inline" if args.no_vllm else "vLLM"
        print(f"{'tokens':>6} {'conc':>4} {'server':<12} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'err':>4}"
              f" {'p50/' + label:>11} {'rps/' + label:>11}")
        for ntok, conc, res in rows:
            v = res[base]
            for name, r in res.items():
                print(f"{ntok:>6} {conc:>4} {name:<12} {r['p50']:>8.1f} {r['p99']:>8.1f} {r['rps']:>8.1f} "
                      f"{r['errors']:>4} {r['p50'] / v['p50']:>11.2f} {r['rps'] / v['rps']:>11.2f}")
    finally:
        if vllm is not None:
            stop_vllm(vllm)
        live.stop()


if __name__ == "__main__":
    main()
