"""What the test suite (``tests/``) and the benchmarks (``bench/``) both run: real platforms and their processes,
started from a checkout. Neither ``tests/`` nor ``bench/`` owns it, and it imports neither (pyproject.toml's
import-linter contract); what only tests use stays in ``tests/support/``.

- ``assets``: the demo models and tokenizer (built or fetched when missing), all-MiniLM-L6-v2, vLLM's interpreter;
- ``live_platform``: a platform started process by process under ``ops.supervisor.Supervisor`` (Redis, Celery
  workers and beat, engine replicas, uvicorn) on its own key prefix, var folder and database;
- ``manage_runner``: ``manage.py`` commands run by one long-lived Django process per environment;
- ``scratch_db``: a fresh PostgreSQL database per platform, copied from a migrated template;
- ``redis_keys``: deleting a platform's keys;
- ``serve``: ``manage.py serve`` itself (its environment, banner, process tree, stop);
- ``drills``: fault drills against ``manage.py serve`` on private Redis and PostgreSQL servers;
- ``usage_scale``: 100,000 keys and 1,000,000 usage records, built in seconds;
- ``images``: seeded test images; ``minilm_reference``: all-MiniLM-L6-v2 run directly with ``transformers``.

Imports assume the repository and its ``platform/`` folder on ``sys.path`` (pytest's ``pythonpath``; each bench
puts them there).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
