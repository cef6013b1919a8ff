"""Issue 20 benchmark: the vLLM backend through the whole platform vs vLLM's own OpenAI server, same run.

Both sides serve the demo model with vLLM's engine, same dtype, ``max_num_seqs``, ``max_model_len`` and KV cache
(``VLLM_CPU_KVCACHE_SPACE``), and get the same requests: ``--concurrency`` streaming chats at once (the Qwen3 chat
template), each generating exactly ``--max-tokens`` tokens (EOS ignored, greedy), read by the same lean httpx SSE
client (``bench/chat_vs_direct.py``'s):

* platform: a live platform (Redis or ``REDIS_URL``, Celery workers, uvicorn) with the model registered as
  ``backend=vllm`` and one ``python -m inference.engine.vllm_backend`` replica (vLLM's ``LLMEngine`` behind the
  Redis engine link); admission, key limits and usage as for any model;
* vllm: ``python -m vllm.entrypoints.openai.api_server`` on a free port (``/work/shared/reference/peer_vllm.md``).

The sides run one after the other (never both at once on the shared cores): per side one warm-up, then
``--rounds`` measured rounds with prompts no other round used (no prefix-cache hits), the mean over rounds of each
figure. Prints TTFT p50/p99, output tokens/s and the platform/vllm ratio (goal: tokens/s ≥ 0.9x). Usage:
``.venv/bin/python bench/vllm_backend.py [--concurrency 16] [--max-tokens 64] [--rounds 2] [--dtype bfloat16] [--native]``
(``--native``: also the same rounds on our native engine through the same platform, issue 20's CPU goal).
(needs ``.peer/vllm``: ``scripts/setup.sh --vllm``; ``VLLM_PYTHON`` points elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from bench.chat_vs_direct import mean_of, prompts, run_platform
from ops.supervisor import http_ok
from tests.live_platform import MODEL_DIR, VLLM_PYTHON, free_port, start_platform

VLLM_MODEL = "tiny-qwen3-vllm"
NATIVE_MODEL = "tiny-qwen3-native"


def platform_side(args, rounds, warm) -> tuple[list[dict], list[dict]]:
    """Rounds through the platform with the model on the vLLM backend, then (``--native``) on our native engine,
    the same dtype, one replica each; the native engine is started after the vLLM replica stopped."""
    live = start_platform(Path(tempfile.mkdtemp(prefix="bench-vllm-")), max_model_len=args.max_model_len,
                          engine=False, mm_worker=False)
    try:
        return _on_vllm(live, args, rounds, warm), (_on_native(live, args, rounds, warm) if args.native else [])
    finally:
        live.stop()


def _on_native(live, args, rounds, warm) -> list[dict]:
    live.manage("register_model", NATIVE_MODEL, str(MODEL_DIR), "--max-model-len", str(args.max_model_len),
                "--dtype", args.dtype, "--reasoning-parser", "none")
    live.start_engine("engine-native", model=NATIVE_MODEL, extra_args=("--dtype", args.dtype))
    asyncio.run(run_platform(live.base_url, live.api_key, warm, 4, model=NATIVE_MODEL))
    return [asyncio.run(run_platform(live.base_url, live.api_key, convs, args.max_tokens, model=NATIVE_MODEL))
            for convs in rounds]


def _on_vllm(live, args, rounds, warm) -> list[dict]:
    # no reasoning parser: vLLM's server runs without one, so both sides stream the raw text. With the registry's
    # "auto" (qwen3 for this template) a leading whitespace run is held until it is known not to precede <think>;
    # the random-weights model in bfloat16 opens with ~35 newlines, which counted as TTFT (D-270).
    live.manage("register_model", VLLM_MODEL, str(MODEL_DIR), "--max-model-len", str(args.max_model_len),
                "--backend", "vllm", "--dtype", args.dtype, "--reasoning-parser", "none")
    child = live.start_engine("engine-vllm", model=VLLM_MODEL, backend="vllm", extra_args=("--dtype", args.dtype))
    try:
        asyncio.run(run_platform(live.base_url, live.api_key, warm, 4, model=VLLM_MODEL))
        return [asyncio.run(run_platform(live.base_url, live.api_key, convs, args.max_tokens, model=VLLM_MODEL))
                for convs in rounds]
    finally:  # its cores go to the next side
        os.killpg(child.proc.pid, signal.SIGTERM)
        child.proc.wait(60)
        live.sup.children.remove(child)  # stopped on purpose: not a dead child for the supervisor's checks


def vllm_side(args, rounds, warm) -> list[dict]:
    """Rounds against vLLM's own OpenAI server (same engine settings)."""
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    log = open(Path(tempfile.mkdtemp(prefix="bench-vllm-server-")) / "server.log", "wb")
    proc = subprocess.Popen([str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR),
                             "--served-model-name", VLLM_MODEL, "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
                             "--max-num-seqs", "32", "--enforce-eager", "--disable-log-stats"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while not http_ok(base + "/health"):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"vLLM's server did not start (log: {log.name})")
            time.sleep(1)
        asyncio.run(run_platform(base, "none", warm, 4, model=VLLM_MODEL))
        return [asyncio.run(run_platform(base, "none", convs, args.max_tokens, model=VLLM_MODEL)) for convs in rounds]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


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
    args = ap.parse_args()
    if not VLLM_PYTHON.exists():
        sys.exit(f"no vLLM environment at {VLLM_PYTHON}: scripts/setup.sh --vllm")
    warm = prompts(args.concurrency, "warm-up")
    rounds = [prompts(args.concurrency, f"round {r + 1}") for r in range(args.rounds)]
    plat_rounds, native_rounds = platform_side(args, rounds, warm)
    plat = mean_of(plat_rounds)
    server = mean_of(vllm_side(args, rounds, warm))

    print(f"\n{args.concurrency} concurrent streaming chats, {args.max_tokens} new tokens each, demo model, vLLM "
          f"engine ({args.dtype}, CPU) on both sides; mean of {args.rounds} round(s) per side, fresh prompts each")
    print(f"{'':10} {'TTFT p50 s':>11} {'TTFT p99 s':>11} {'tokens/s':>10} {'wall s':>8}")
    sides = [("platform", plat), ("vllm", server)]
    if native_rounds:
        sides.insert(1, ("native", mean_of(native_rounds)))
    for name, r in sides:
        print(f"{name:10} {r['ttft_p50']:11.3f} {r['ttft_p99']:11.3f} {r['tok_s']:10.1f} {r['wall_s']:8.2f}")
    print(f"ratio platform/vllm: tokens/s {plat['tok_s'] / server['tok_s']:.2f}x (goal >= 0.9x), "
          f"TTFT p50 {plat['ttft_p50'] / server['ttft_p50']:.2f}x")
    if native_rounds:
        native = sides[1][1]
        print(f"ratio native engine (platform)/vllm: tokens/s {native['tok_s'] / server['tok_s']:.2f}x (goal >= 1.0x), "
              f"TTFT p50 {native['ttft_p50'] / server['ttft_p50']:.2f}x")


if __name__ == "__main__":
    main()
