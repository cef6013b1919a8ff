#!/usr/bin/env bash
# One command on a fresh machine: set up, then run the test suite (arguments go to pytest).
# Uses REDIS_URL / DATABASE_URL when set (CI: the machine's Redis and PostgreSQL), else embedded defaults.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/setup.sh --vllm all  # --vllm: the vLLM backend tests need .peer/vllm
# The dashboard test drives Debian's Chromium (never a downloaded browser build).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian's chromium for the dashboard browser test"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "warning: could not install chromium; the browser test will be skipped" >&2
fi
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
