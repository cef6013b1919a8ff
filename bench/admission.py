"""Admission-control benchmark (issue 3): TTFT of accepted requests under overload, with and without a limit.

Starts the real platform (harness/live_platform.py: Redis from REDIS_URL or embedded, Celery worker+beat, one
engine replica of the tiny demo model, uvicorn), then:

1. measures capacity in the same run: a closed loop of ``--concurrency`` clients sending equal prompts
   (``--prompt-len`` token ids, ``max_tokens=1``, so a request is prefill + one token) for
   ``--calib-s`` seconds; capacity = completed prompt tokens per second end to end (the engine's own
   ``prefill_tokens_per_s`` heartbeat is printed too; on this CPU box the api/worker side, not the
   engine, bounds the end-to-end rate, so the end-to-end figure is the honest one to size with);
2. offers open-loop load (uniform arrivals) at 1.4× capacity for ``--duration`` seconds with the queue
   unbounded, then with ``max_num_queued_tokens = target_TTFT × capacity``, then at 0.64× with the limit.

TTFT here is the latency of a ``max_tokens=1`` request (first token = last token). The CPU engine runs with
``--engine-threads`` torch threads (default: all cores but one): on a shared CPU box an engine that takes
every core leaves the api process, the workers and Redis only preempted slices, and a refusal's latency is
then mostly scheduling (p99 of a 503 measured on 2 cores: ~9-11 ms with 2 engine threads, ~6 ms with 1). Printed per run:
accepted, refused, worst and p99 TTFT of accepted requests, p99 latency of a 503.

    REDIS_URL=redis://127.0.0.1:6379/12 .venv/bin/python bench/admission.py [--target-ttft-s 2]

``--serve-layout`` measures refusal latency under the default ``manage.py serve`` layout instead (issue 17): in a
temporary ``var/`` (SQLite, embedded Redis), it registers four models (the chat demo ``tiny-qwen3``, a second chat
model ``tiny-qwen3-limited`` with ``max_num_queued_reqs`` 4, all-MiniLM-L6-v2 embeddings, the vision demo
``tiny-vl``), runs ``manage.py serve --demo`` with no layout flags (``--serve-args`` adds some, e.g.
``"--engine-threads 2 --engine-nice 0"`` for the layout before issue 17), then sends ``--bursts`` bursts of
``--streams`` concurrent streaming chats to the limited model and prints the latency of the 503s (time to the
whole refusal, headers and body) and of the accepted streams' first chunk.

    .venv/bin/python bench/admission.py --serve-layout [--bursts 10] [--streams 24] [--serve-args "..."]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from bench.lib.completions_load import calibrate, offer
from bench.lib.stats import pct
from harness.assets import DEMO_MODEL, MODEL_DIR, ensure_demo_assets
from harness.live_platform import child_env, free_port, run_manage, start_platform


LIMITED_MODEL = "tiny-qwen3-limited"


async def stream_one(session: aiohttp.ClientSession, url: str, headers: dict, body: bytes) -> tuple[int, float]:
    """POST a streaming chat; ``(status, seconds)``: for a 200, until the first chunk; else until the whole
    answer (a refusal's body included); status 0 when the connection failed."""
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=headers) as r:
            if r.status != 200:
                await r.read()
                return r.status, time.perf_counter() - t0
            await r.content.readany()
            first = time.perf_counter() - t0
            await r.read()
            return 200, first
    except aiohttp.ClientError:
        return 0, time.perf_counter() - t0


async def bursts(base: str, key: str, n_bursts: int, streams: int, max_tokens: int) -> list[list[tuple[int, float]]]:
    """``n_bursts`` bursts of ``streams`` concurrent streaming chats on the limited model, each burst once the
    previous one has finished; one connection per request, as separate clients would open."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    url = f"{base}/v1/chat/completions"
    out = []
    connector = aiohttp.TCPConnector(limit=streams * 2, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        for b in range(n_bursts):
            bodies = [json.dumps({"model": LIMITED_MODEL, "stream": True, "max_tokens": max_tokens,
                                  "ignore_eos": True, "messages": [{"role": "user", "content": f"burst {b} stream {i}: "
                                                                    "tell me a long story"}]}).encode()
                      for i in range(streams)]
            out.append(await asyncio.gather(*(stream_one(session, url, headers, body) for body in bodies)))
            await asyncio.sleep(0.5)
    return out


def _proc_stat(pid: int) -> tuple[int, int]:
    """``(nice, threads)`` of ``pid`` from ``/proc/PID/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[16]), int(fields[17])


def _engines(serve_pid: int) -> list[str]:
    """One line per engine process under ``serve_pid``: model, ``--num-threads``, nice, OS threads."""
    import subprocess

    rows = []
    for line in subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout.splitlines():
        pid, ppid, cmd = line.split(None, 2)
        if int(ppid) == serve_pid and "inference.engine" in cmd:
            argv = cmd.split()
            threads = argv[argv.index("--num-threads") + 1] if "--num-threads" in argv else "all"
            nice, os_threads = _proc_stat(int(pid))
            rows.append(f"  {argv[argv.index('--model') + 1]:<20} --num-threads {threads:<4} nice {nice:<3} "
                        f"OS threads {os_threads}")
    return rows


def serve_layout(args) -> int:
    """The ``--serve-layout`` mode (see the module docstring)."""
    import shlex
    import subprocess

    from harness.assets import minilm_dir, VL_DIR, VL_MODEL, ensure_vl_model
    from harness.serve import banner_key, serve_banner, stop_serve

    ensure_demo_assets()
    ensure_vl_model()
    with tempfile.TemporaryDirectory() as tmp:
        _var, _prefix, env, _scratch = child_env(Path(tmp), "bsl")
        env.pop("REDIS_URL", None)  # the default layout: serve's embedded Redis, SQLite
        env.pop("DATABASE_URL", None)
        env["EMBEDDED_REDIS_PORT"] = str(free_port())
        run_manage(env, "migrate", "--verbosity", "0")
        run_manage(env, "register_model", LIMITED_MODEL, str(MODEL_DIR), "--max-model-len", "2048")
        run_manage(env, "register_model", "all-MiniLM-L6-v2", minilm_dir(), "--task", "embed")
        run_manage(env, "register_model", VL_MODEL, str(VL_DIR), "--max-model-len", "1024")
        port = free_port()
        proc = subprocess.Popen([sys.executable, str(REPO / "manage.py"), "serve", "--demo", "--port", str(port),
                                 *shlex.split(args.serve_args)], env=env, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            key = banner_key(serve_banner(proc.stdout, 900))
            run_manage(env, "admission_policy", LIMITED_MODEL, "--max-num-queued-reqs", "4")
            print(f"serve {args.serve_args or '(defaults)'} on {len(os.sched_getaffinity(0))} cores; engines:")
            print("\n".join(_engines(proc.pid)))
            base = f"http://127.0.0.1:{port}"
            asyncio.run(bursts(base, key, 1, args.streams, args.max_tokens))  # warm-up, not counted
            load_before = os.getloadavg()[0]
            results = asyncio.run(bursts(base, key, args.bursts, args.streams, args.max_tokens))
            print(f"machine load (1 min average, all users): {load_before:.1f} before the bursts, "
                  f"{os.getloadavg()[0]:.1f} after")
        finally:
            stop_serve(proc)
    refused = [lat for burst in results for status, lat in burst if status == 503]
    ok = [lat for burst in results for status, lat in burst if status == 200]
    other = [status for burst in results for status, _ in burst if status not in (200, 503)]
    print(f"\n{args.bursts} bursts of {args.streams} streams on {LIMITED_MODEL} (max_num_queued_reqs 4): "
          f"{len(ok)} accepted, {len(refused)} refused, {len(other)} other {sorted(set(other))}")
    print(f"503 latency ms: p50 {pct(refused, 0.5) * 1000:.1f}  p90 {pct(refused, 0.9) * 1000:.1f}  "
          f"p99 {pct(refused, 0.99) * 1000:.1f}  max {max(refused, default=float('nan')) * 1000:.1f}  (goal p99 <= 50)")
    print(f"accepted, first chunk ms: p50 {pct(ok, 0.5) * 1000:.1f}  p99 {pct(ok, 0.99) * 1000:.1f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=1536,
                    help="long enough that the engine, not the api process, is the bottleneck on 2 cores")
    ap.add_argument("--target-ttft-s", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--calib-s", type=float, default=6.0)
    # about as many in flight as the limited run holds (target 2 s x ~30 req/s): the api-side cost of that
    # many open requests is in the measured capacity, as it will be under the offered load
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--engine-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="torch threads of the CPU engine (default: all cores but one, left to the api process, "
                         "workers and Redis, as vLLM's CPU guide reserves cores for the serving frontend)")
    ap.add_argument("--serve-layout", action="store_true",
                    help="measure 503 latency under manage.py serve's default layout with four models (issue 17)")
    ap.add_argument("--serve-args", default="", help="--serve-layout: extra manage.py serve arguments")
    ap.add_argument("--bursts", type=int, default=10, help="--serve-layout: bursts measured (after one warm-up)")
    ap.add_argument("--streams", type=int, default=24, help="--serve-layout: concurrent streams per burst")
    ap.add_argument("--max-tokens", type=int, default=64, help="--serve-layout: tokens per accepted stream")
    args = ap.parse_args()
    if args.serve_layout:
        return serve_layout(args)
    os.environ["ENGINE_EXTRA_ARGS"] = f"{os.environ.get('ENGINE_EXTRA_ARGS', '')} --num-threads {args.engine_threads}"
    print(f"engine: {args.engine_threads} torch thread(s) on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        live = start_platform(Path(tmp), max_model_len=max(512, args.prompt_len + 8))
        try:
            base, key = live.base_url, live.api_key
            tps = asyncio.run(calibrate(base, key, args.prompt_len, args.concurrency, args.calib_s))
            engine_tps = sum(s.prefill_tokens_per_s for s in live.replicas())
            cap_rps = tps / args.prompt_len
            limit = max(1, int(args.target_ttft_s * tps))
            print(f"capacity (end to end): {tps:.0f} prompt tokens/s = {cap_rps:.1f} req/s of {args.prompt_len} "
                  f"tokens; engine-reported prefill {engine_tps:.0f} tokens/s")
            print(f"target TTFT {args.target_ttft_s:.2f} s -> max_num_queued_tokens = {limit}")
            rows = []
            for label, factor, lim in (("1.4x unbounded", 1.4, None), ("1.4x limited", 1.4, limit),
                                       ("0.64x limited", 0.64, limit)):
                live.manage("admission_policy", DEMO_MODEL, "--max-num-queued-reqs", "none",
                            "--max-num-queued-tokens", "none" if lim is None else str(lim))
                time.sleep(1.0)
                res = asyncio.run(offer(base, key, args.prompt_len, factor * cap_rps, args.duration))
                rows.append((label, res))
                time.sleep(2.0)
            print()
            print(f"{'run':<16} {'offered':>7} {'accepted':>8} {'refused':>7} {'other':>5} {'worst TTFT s':>12} "
                  f"{'p99 TTFT s':>10} {'p99 503 ms':>10}")
            for label, r in rows:
                print(f"{label:<16} {r['offered']:>7} {r['accepted']:>8} {r['refused']:>7} {r['other']:>5} "
                      f"{r['worst']:>12.2f} {r['p99']:>10.2f} {r['p99_503_ms']:>10.1f}")
            lim_p99 = rows[1][1]["p99"]
            print(f"\nlimited p99 TTFT / target = {lim_p99 / args.target_ttft_s:.2f} (goal <= 1.25); "
                  f"unbounded worst / target = {rows[0][1]['worst'] / args.target_ttft_s:.1f} (goal: several); "
                  f"refusals at 0.64x = {rows[2][1]['refused']} (goal 0)")
        finally:
            live.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
