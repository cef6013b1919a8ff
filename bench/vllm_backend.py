"""Issue 20 benchmark: the vLLM backend through the whole platform vs vLLM's own OpenAI server, same run.

Both sides serve the demo model with vLLM's engine, same dtype, ``max_num_seqs``, ``max_model_len`` and KV cache
(``VLLM_CPU_KVCACHE_SPACE``), and get the same requests: ``--concurrency`` streaming chats at once (the Qwen3 chat
template), each generating exactly ``--max-tokens`` tokens (EOS ignored, greedy), read by the same lean httpx SSE
client (``bench.lib.chat_stream``):

* platform: a live platform (Redis or ``REDIS_URL``, Celery workers, uvicorn) with the model registered as
  ``backend=vllm`` and one ``python -m inference.engine.vllm_backend`` replica (vLLM's ``LLMEngine`` behind the
  Redis engine link); admission, key limits and usage as for any model;
* vllm: ``python -m vllm.entrypoints.openai.api_server`` on a free port (``.peer/vllm``: ``scripts/setup.sh --vllm``).

All sides are up at once (an idle engine blocks on its queue) and take turns, never two at once on the shared
cores: one warm-up each, then ``--rounds`` measured rounds with prompts no other round used (no prefix-cache hits),
each round starting with the next side, so a drift in the machine's load spreads over all sides; the mean over
rounds of each figure. Prints TTFT p50/p99, output tokens/s and the platform/vllm ratio (goal: tokens/s ≥ 0.9x).
Also the CPU time every process on the machine spent during each side's rounds (``/proc/<pid>/stat``, read before and
after each round; processes grouped by role: ``bench.lib.proc_cpu.describe``), as CPU seconds per 1,000 output
tokens: how much of the cores the side's model forward had, and how much went to its frontend. Usage:
``.venv/bin/python bench/vllm_backend.py [--concurrency 16] [--max-tokens 64] [--rounds 2] [--dtype bfloat16] [--native]``
(``--native``: also the same rounds on our native engine through the same platform, issue 20's CPU goal; it runs
as ``manage.py serve`` runs a CPU engine, one core left to the frontend at niceness 10, unless
``--native-layout all-cores``).
(needs ``.peer/vllm``: ``scripts/setup.sh --vllm``; ``VLLM_PYTHON`` points elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from bench.lib.chat_stream import mean_of, prompts, run_platform
from bench.lib.proc_cpu import describe, proc_cpu_s
from bench.lib.vllm_server import IDLE_GAP_S, start_vllm, stop_vllm
from harness.assets import MODEL_DIR, VLLM_PYTHON
from harness.live_platform import free_port, start_platform

VLLM_MODEL = "tiny-qwen3-vllm"
NATIVE_MODEL = "tiny-qwen3-native"


def role(proc: psutil.Process) -> str:
    """What a process is for this benchmark: ``describe``'s label for the platform's processes; a process started
    by an engine replica or by vLLM's api server (vLLM's engine core, its workers) under its ancestor's label
    (``engine MODEL/child``, ``vllm api server/child``); ``other`` for the rest of the machine (this script
    included)."""
    try:
        argv = " ".join(proc.cmdline())
        ancestors = proc.parents()
        if "vllm.entrypoints" in argv:
            return "vllm api server"
        for up in ancestors:
            up_argv = " ".join(up.cmdline())
            if "vllm.entrypoints" in up_argv:
                return "vllm api server/child"
            if "inference.engine" in up_argv:
                return describe(up) + "/child"
        label = describe(proc)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "other"
    if label in ("api", "redis", "celery beat") or label.startswith(("celery worker", "engine ")):
        return label
    return "other"


def cpu_snapshot() -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) of every process on the machine."""
    out: dict[int, tuple[str, float]] = {}
    for proc in psutil.process_iter():
        cpu = proc_cpu_s(proc.pid)
        if cpu is not None:
            out[proc.pid] = (role(proc), cpu)
    return out


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """role -> CPU seconds spent between two snapshots (processes in both; a process that started in between counts
    from 0)."""
    out: dict[str, float] = defaultdict(float)
    for pid, (label, cpu) in after.items():
        out[label] += cpu - before.get(pid, (label, 0.0))[1]
    return dict(out)


def start_platform_side(args) -> tuple[object, list[tuple[str, str, str, str]]]:
    """A live platform serving the demo model on the vLLM backend and (``--native``) on our native engine, the same
    dtype, one replica each. Returns ``(live platform, [(side name, base url, api key, model)]``).

    No reasoning parser on either model: vLLM's server runs without one, so every side streams the raw text. With
    the registry's ``auto`` (``qwen3`` for this template) a leading whitespace run is held until it is known not to
    precede ``<think>``; the random-weights model in bfloat16 opens with ~35 newlines, which counted as TTFT (D-270).
    """
    live = start_platform(Path(tempfile.mkdtemp(prefix="bench-vllm-")), max_model_len=args.max_model_len,
                          engine=False, mm_worker=False)
    try:
        live.manage("register_model", VLLM_MODEL, str(MODEL_DIR), "--max-model-len", str(args.max_model_len),
                    "--backend", "vllm", "--dtype", args.dtype, "--reasoning-parser", "none")
        live.start_engine("engine-vllm", model=VLLM_MODEL, backend="vllm", extra_args=("--dtype", args.dtype))
        sides = [("platform", live.base_url, live.api_key, VLLM_MODEL)]
        if args.native:
            live.manage("register_model", NATIVE_MODEL, str(MODEL_DIR), "--max-model-len", str(args.max_model_len),
                        "--dtype", args.dtype, "--reasoning-parser", "none")
            live.start_engine("engine-native", model=NATIVE_MODEL, extra_args=("--dtype", args.dtype),
                              serve_layout=args.native_layout == "serve")
            sides.append(("native", live.base_url, live.api_key, NATIVE_MODEL))
        return live, sides
    except BaseException:
        live.stop()
        raise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2,
                    help="measured rounds per side, after one warm-up; each round's prompts are new")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--native", action="store_true",
                    help="also our native engine through the platform (issue 20: >= 1.0x vLLM's server at 16 streams)")
    ap.add_argument("--native-layout", choices=["serve", "all-cores"], default="serve",
                    help="the native engine's CPU share: serve (default): as `manage.py serve` and quickstart start it, "
                         "the cores less one for the frontend, at niceness 10, as vLLM's CPU engine leaves a core to "
                         "its api server; all-cores: torch's default, every core at normal priority (D-302)")
    args = ap.parse_args()
    if not VLLM_PYTHON.exists():
        sys.exit(f"no vLLM environment at {VLLM_PYTHON}: scripts/setup.sh --vllm")
    warm = prompts(args.concurrency, "warm-up")
    rounds = [prompts(args.concurrency, f"round {r + 1}") for r in range(args.rounds)]
    live, sides = start_platform_side(args)
    try:
        port = free_port()
        proc = start_vllm(str(VLLM_PYTHON), port, Path(tempfile.mkdtemp(prefix="bench-vllm-server-")) / "server.log",
                          max_model_len=args.max_model_len, ready_timeout_s=600, served_name=VLLM_MODEL,
                          dtype=args.dtype, extra_args=("--max-num-seqs", "32", "--disable-log-stats"))
        base = f"http://127.0.0.1:{port}"
        try:
            sides.append(("vllm", base, "none", VLLM_MODEL))
            for _name, url, key, model in sides:
                asyncio.run(run_platform(url, key, warm, 4, model=model))
            results: dict[str, list[dict]] = {name: [] for name, *_ in sides}
            cpu: dict[str, dict[str, float]] = {name: defaultdict(float) for name, *_ in sides}
            for r, convs in enumerate(rounds):  # the sides take turns, each round starting with the next one
                for name, url, key, model in sides[r % len(sides):] + sides[:r % len(sides)]:
                    time.sleep(IDLE_GAP_S)
                    before = cpu_snapshot()
                    res = asyncio.run(run_platform(url, key, convs, args.max_tokens, model=model))
                    for label, spent in cpu_delta(before, cpu_snapshot()).items():
                        cpu[name][label] += spent
                    cpu[name]["(wall × cores)"] += res["wall_s"] * (os.cpu_count() or 1)
                    results[name].append(res)
                    print(f"round {r + 1} {name:9} TTFT p50 {res['ttft_p50']:.3f} s, {res['tok_s']:.1f} tokens/s",
                          flush=True)
        finally:
            stop_vllm(proc)
    finally:
        live.stop()
    means = {name: mean_of(rs) for name, rs in results.items()}
    server = means["vllm"]
    print(f"\n{args.concurrency} concurrent streaming chats, {args.max_tokens} new tokens each, demo model ({args.dtype}, "
          f"CPU); platform = the vLLM backend through the platform, native = our engine through the platform, vllm = "
          f"vLLM's own server; {args.rounds} round(s) per side, taking turns, fresh prompts each round; means")
    print(f"{'':10} {'TTFT p50 s':>11} {'TTFT p99 s':>11} {'tokens/s':>10} {'wall s':>8}")
    for name, r in means.items():
        print(f"{name:10} {r['ttft_p50']:11.3f} {r['ttft_p99']:11.3f} {r['tok_s']:10.1f} {r['wall_s']:8.2f}")
    print("\nCPU seconds per 1,000 output tokens during each side's rounds, by process (every process on the machine; "
          "'(wall × cores)' is what the cores could give)")
    for name, spent in cpu.items():
        tokens = sum(r["tokens"] for r in results[name]) / 1000
        parts = ", ".join(f"{label} {s / tokens:.2f}" for label, s in sorted(spent.items(), key=lambda kv: -kv[1])
                          if s / tokens >= 0.01)
        print(f"{name:10} {parts}")
    for name, goal in (("platform", 0.9), ("native", 1.0)):
        if name in means:
            print(f"ratio {name}/vllm: tokens/s {means[name]['tok_s'] / server['tok_s']:.2f}x (goal >= {goal}x), "
                  f"TTFT p50 {means[name]['ttft_p50'] / server['ttft_p50']:.2f}x")


if __name__ == "__main__":
    main()
