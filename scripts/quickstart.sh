#!/usr/bin/env bash
# One command on a fresh machine: set up, then run the whole platform (embedded Redis + SQLite unless
# REDIS_URL / DATABASE_URL are set) with the demo model, an operator account and a printed API key.
# Extra arguments go to `manage.py serve` (e.g. --port 8001). Ctrl-C stops every process.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/setup.sh qwen3
exec .venv/bin/python manage.py serve --demo "$@"
