#!/usr/bin/env bash
# GPU check of the engine (issue 20), one prepared script, at most 8 minutes:
#   bench/gpu_check.sh                 # CUDA: Qwen3-0.6B-config random model; ours (+ vLLM from .peer/vllm if present)
#   bench/gpu_check.sh --dry-run       # no GPU: the CPU-safe parts at tiny sizes, in seconds
#   bench/gpu_check.sh --device cpu --small [--concurrency 1,16]
# Output tokens/s at 1, 16 and 64 concurrent streams and TTFT p50 (bench/gpu_check.py has the details).
# PYTHON picks the interpreter (default: .venv/bin/python if present, else python3); it needs torch (a CUDA
# build on a GPU machine) and transformers 5.24.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true; fi
exec timeout 480 env PYTHONPATH=. HF_HUB_OFFLINE=1 "$PY" bench/gpu_check.py "$@"
