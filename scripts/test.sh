#!/usr/bin/env bash
# One command on a fresh machine: set up, then run the test suite (arguments go to pytest).
# Uses REDIS_URL / DATABASE_URL when set (CI: the machine's Redis and PostgreSQL), else embedded defaults.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/setup.sh all
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
