"""CLI: ``python -m inference.engine --model NAME --model-dir DIR --redis-url URL [options]``.

Options: ``--device cpu|cuda`` (default cpu), ``--dtype float32|bfloat16|float16`` (default float32 on
CPU, bfloat16 on CUDA), ``--max-num-seqs 32``, ``--max-model-len N`` (default: the model's
``max_position_embeddings``), ``--max-num-batched-tokens N`` (tokens one step computes at most: the running
decodes plus prompt chunks; default 512 on CPU, 2048 on CUDA, 4096 for ``--task embed``; ``--max-prefill-tokens`` is an old name for it),
``--no-enable-chunked-prefill`` (prefill each prompt whole, as before chunking), ``--link-prefix llmp``, ``--engine-id ID``
(default random), ``--num-threads N`` (CPU intra-op threads; default the CPUs this process
may use: ``default_num_threads``), ``--log-level``,
``--task generate|embed`` (default generate; ``embed`` runs the pooling mode of ``inference.engine.pooling``),
``--prefix-cache-mb 256`` (prompt K/V kept for reuse by prompts with the same prefix; 0 disables),
``--step-watchdog-s 300`` (a step loop that does not turn over this long ends the process: ``watchdog.py``; 0 off).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from inference.shared.config import SETTINGS

from .core import EngineCore, install_signal_handlers, new_engine_id, replica_stats
from .prefix_cache import DEFAULT_PREFIX_CACHE_MB
from .replica_link import BlockSource, ReplicaLink
from .watchdog import EXIT_STEP_LOOP_WEDGED, STEP_WATCHDOG_S, watchdog_seconds

if TYPE_CHECKING:
    from .base_scheduler import BaseScheduler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the engine's command line."""
    ap = argparse.ArgumentParser(prog="python -m inference.engine", description="LLM engine replica")
    ap.add_argument("--model", required=True, help="served model name (engine link keys)")
    ap.add_argument("--model-dir", required=True, help="Hugging Face-format model directory")
    ap.add_argument("--redis-url", default=SETTINGS.redis_url or "redis://127.0.0.1:6379/0",
                    help="default: $REDIS_URL; pass a URL holding a password in REDIS_URL, since a command line "
                         "is visible to every local user (ps)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", "--max-prefill-tokens", dest="max_num_batched_tokens", type=int,
                    default=None, help="tokens one step computes at most (decodes + prompt chunks); default 512 on "
                                       "CPU, 2048 on CUDA, 4096 for --task embed")
    ap.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                    help="prefill long prompts a chunk at a time between decode steps (default on)")
    ap.add_argument("--link-prefix", default="llmp")
    ap.add_argument("--engine-id", default=None)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--task", choices=["generate", "embed"], default="generate",
                    help="generate (causal LM) or embed (pooling mode, encoder models)")
    ap.add_argument("--prefix-cache-mb", type=float, default=DEFAULT_PREFIX_CACHE_MB,
                    help="MiB of prompt K/V kept for prompts that share a prefix (0 disables)")
    ap.add_argument("--step-watchdog-s", type=watchdog_seconds, default=STEP_WATCHDOG_S,
                    help="seconds the step loop may go without turning over before the replica withdraws and exits "
                         f"with status {EXIT_STEP_LOOP_WEDGED}, for its supervisor to restart it (default "
                         f"{STEP_WATCHDOG_S:.0f}; 0 turns the watchdog off)")
    ap.add_argument("--log-level", default=SETTINGS.engine_log_level)
    return ap.parse_args(argv)


def default_num_threads() -> int:
    """A CPU engine's torch intra-op threads when ``--num-threads`` is not given: the CPUs this process may use,
    as joblib's ``cpu_count`` counts them (its CPU affinity, a cgroup CPU quota such as a container's ``cpus`` or a
    Kubernetes CPU limit, ``LOKY_MAX_CPU_COUNT``), at least 1. Not ``os.cpu_count()``, the host's count: in a
    container limited to 4 of a host's 64 cores it gave 64 spinning OpenMP threads time-sliced on 4 cores."""
    from joblib import cpu_count

    return max(1, int(cpu_count()))


def _scheduler(args: argparse.Namespace, engine_id: str, dtype: str, batched: int
               ) -> tuple[BaseScheduler, BlockSource | None]:
    """The scheduler of ``args.task`` over its loaded runner, and the prefix cache whose blocks the link mirrors
    (None when there is none)."""
    # lazy loads of torch and the model code, after the arguments parse (``--help`` and a bad flag answer at once)
    if args.task == "embed":
        from .pooling import PoolingRunner, PoolingScheduler

        pooling = PoolingRunner(args.model_dir, device=args.device, dtype=dtype, max_model_len=args.max_model_len)
        stats = replica_stats(engine_id, args.model, pooling.device.type, args.max_num_seqs)
        return PoolingScheduler(pooling, engine_id, stats, max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=batched), None
    from .runner import ModelRunner
    from .scheduler import Scheduler
    from .vl_runner import VLModelRunner, is_vision_language

    if is_vision_language(args.model_dir):  # images: features come from the shared mm cache
        runner: ModelRunner = VLModelRunner(args.model_dir, device=args.device, dtype=dtype,
                                            max_model_len=args.max_model_len, redis_url=args.redis_url,
                                            link_prefix=args.link_prefix, prefix_cache_mb=args.prefix_cache_mb)
    else:
        runner = ModelRunner(args.model_dir, device=args.device, dtype=dtype, max_model_len=args.max_model_len,
                             prefix_cache_mb=args.prefix_cache_mb)
    stats = replica_stats(engine_id, args.model, runner.device.type, args.max_num_seqs)
    return Scheduler(runner, engine_id, stats, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=batched,
                     enable_chunked_prefill=args.enable_chunked_prefill), runner.prefix_cache


def main(argv: list[str] | None = None) -> int:
    """Load the model, then serve the engine link until SIGTERM/SIGINT. Returns the exit status."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s engine[%(process)d] %(message)s")
    import torch

    if args.device == "cpu":
        torch.set_num_threads(args.num_threads or default_num_threads())
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    # a step's token budget: on the CPU a 512-token chunk of the demo model is one decode step's time or so
    # (bench/long_prefill.py); a GPU computes far more tokens per forward before it is slower. The pooling mode
    # has no decodes to protect: its padded batch keeps the old 4096.
    batched = args.max_num_batched_tokens or (4096 if args.task == "embed" else 512 if args.device == "cpu" else 2048)

    engine_id = args.engine_id or new_engine_id()
    scheduler, blocks = _scheduler(args, engine_id, dtype, max(batched, args.max_num_seqs))
    link = ReplicaLink(args.model, args.redis_url, engine_id, link_prefix=args.link_prefix, blocks=blocks,
                       step_watchdog_s=args.step_watchdog_s)
    core = EngineCore(link, scheduler)
    install_signal_handlers(core)
    core.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
