"""CLI: ``python -m inference.engine.vllm_backend --model NAME --model-dir DIR [options]`` (run by vLLM's environment).

The options of ``python -m inference.engine`` that mean something to vLLM, with the same names and defaults:
``--redis-url`` (default ``$REDIS_URL``), ``--device cpu|cuda``, ``--dtype float32|bfloat16|float16|auto``,
``--max-num-seqs 32``, ``--max-model-len N``, ``--link-prefix llmp``, ``--engine-id ID``, ``--num-threads N``
(CPU threads of vLLM's worker, ``VLLM_CPU_OMP_THREADS_BIND``), ``--log-level``, ``--step-watchdog-s 300``; and
``--tokenizer-dir DIR`` (default the model directory), ``--kv-cache-gb 1`` (CPU only: ``VLLM_CPU_KVCACHE_SPACE``),
``--gpu-memory-utilization 0.9`` (CUDA only). Ignored (accepted so a command line of the native engine runs):
``--max-prefill-tokens``, ``--prefix-cache-mb`` (vLLM's prefix cache lives in its KV cache), ``--task generate``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from inference.shared.config import SETTINGS, set_engine_environ

from ..core import EngineCore, install_signal_handlers, new_engine_id, replica_stats
from ..replica_link import ReplicaLink
from ..watchdog import EXIT_STEP_LOOP_WEDGED, STEP_WATCHDOG_S, watchdog_seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the vLLM backend's command line."""
    ap = argparse.ArgumentParser(prog="python -m inference.engine.vllm_backend",
                                 description="LLM engine replica: vLLM's engine behind the Redis engine link")
    ap.add_argument("--model", required=True, help="served model name (engine link keys)")
    ap.add_argument("--model-dir", required=True, help="Hugging Face-format model directory")
    ap.add_argument("--tokenizer-dir", default=None)
    ap.add_argument("--redis-url", default=SETTINGS.redis_url or "redis://127.0.0.1:6379/0",
                    help="default: $REDIS_URL (a URL with a password belongs there, not on a command line)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"], default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--link-prefix", default="llmp")
    ap.add_argument("--engine-id", default=None)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--kv-cache-gb", type=int, default=1, help="GiB of KV cache (CPU; vLLM takes whole GiB)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-prefill-tokens", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prefix-cache-mb", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--task", choices=["generate"], default="generate")
    ap.add_argument("--step-watchdog-s", type=watchdog_seconds, default=STEP_WATCHDOG_S,
                    help="seconds the step loop may go without turning over before the replica withdraws and exits "
                         f"with status {EXIT_STEP_LOOP_WEDGED}, for its supervisor to restart it (default "
                         f"{STEP_WATCHDOG_S:.0f}; 0 turns the watchdog off)")
    ap.add_argument("--log-level", default=SETTINGS.engine_log_level)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Start vLLM's engine, then serve the engine link until SIGTERM/SIGINT; then leave with status 0 (``os._exit``)."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s engine-vllm[%(process)d] %(message)s")
    env = {"HF_HUB_OFFLINE": "1"}  # a local directory: never reach the network
    if args.device == "cpu":  # vLLM's CPU worker reads these when it starts (vllm/envs.py)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gb)
        if args.num_threads:
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(args.num_threads))
    set_engine_environ(env)

    from .runner import VllmRunner
    from .scheduler import VllmScheduler

    extra = {"gpu_memory_utilization": args.gpu_memory_utilization} if args.device == "cuda" else {}
    runner = VllmRunner(args.model_dir, tokenizer_dir=args.tokenizer_dir, device=args.device, dtype=args.dtype,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        enforce_eager=args.device == "cpu", **extra)
    engine_id = args.engine_id or new_engine_id()
    stats = replica_stats(engine_id, args.model, args.device, args.max_num_seqs)
    # vLLM's prefix cache lives in its engine core: no block set to mirror for the router
    link = ReplicaLink(args.model, args.redis_url, engine_id, link_prefix=args.link_prefix,
                       step_watchdog_s=args.step_watchdog_s)
    core = EngineCore(link, VllmScheduler(runner, engine_id, stats, max_num_seqs=args.max_num_seqs))
    install_signal_handlers(core)
    core.run()
    # vLLM's engine-core process is stopped (the scheduler's shutdown) and every output is flushed; its client's background threads could
    # still hold the interpreter at exit (seen: 15 s and more after SIGTERM), so the process leaves at once
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
