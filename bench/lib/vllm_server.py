"""vLLM's own OpenAI api server (``.peer/vllm``, installed by ``scripts/setup.sh --vllm``; README "Engine backends")
on the demo model: the reference the frontend and engine benchmarks compare against."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from harness.assets import MODEL_DIR


# Pause before each measured round: a vLLM engine's worker keeps busy-polling its shared-memory queue (with
# sched_yield) for 1 s after its last step (vLLM's ``SpinCondition``, ``busy_loop_s``), which took a core from the
# side that ran next (its TTFT rose from ~0.1 s to ~0.9 s).
IDLE_GAP_S = 2.0


def start_vllm(python: str, port: int, log: Path, max_model_len: int = 4096,
               ready_timeout_s: float = 300, *, served_name: str = "tiny-qwen3", dtype: str = "bfloat16",
               extra_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """vLLM's CPU api server on the demo model (served as ``served_name``, ``dtype``, more server options in
    ``extra_args``) at ``port``, once healthy (its whole process group killed when it does not get there within
    ``ready_timeout_s``)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    if max_model_len > 4096:  # the demo model's max_position_embeddings; /tokenize-only runs may go past it
        env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR),
                             "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager", *extra_args],
                            env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    raise RuntimeError(f"vLLM did not become healthy within {ready_timeout_s:g} s; see {log}")


def stop_vllm(proc: subprocess.Popen) -> None:
    """Stop a server from ``start_vllm``: SIGTERM, then SIGKILL when it has not exited within 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
