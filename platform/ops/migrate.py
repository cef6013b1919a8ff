"""Database migrations when several ``serve`` processes start at once (e.g. two render-only frontends,
``serve --no-engine``, brought up together against one empty PostgreSQL database).

Django's ``migrate`` takes no lock of its own: two at once on an empty database both try to create the same tables
and one fails (``relation ... already exists`` / a duplicate key in ``django_content_type``), taking its ``serve``
down. Every ``serve`` shares the platform's Redis, so the migration runs under a Redis lock there (redis-py's
``Lock``: a token-checked ``SET NX PX`` released by a Lua script); the second process waits, then finds nothing left
to apply. Deployments with a migrate job of their own (``deploy/k8s/migrate-job.yaml``) are unaffected.
"""

from __future__ import annotations

from typing import Any

from django.core.management import call_command

# Longest a migration run may hold the lock (seconds): past it the lock expires, so a process killed while migrating
# never blocks the next start for longer. Waiters wait as long.
MIGRATE_LOCK_TIMEOUT_S = 600


def migrate_lock_key(prefix: str) -> str:
    """Redis key of the migration lock of the platform whose link prefix is ``prefix``."""
    return f"{prefix}:ops:migrate-lock"


def migrate_serialized(client: Any, prefix: str, *, timeout_s: float = MIGRATE_LOCK_TIMEOUT_S) -> None:
    """``manage.py migrate`` (no input, quiet) while holding ``migrate_lock_key(prefix)`` on ``client`` (a
    ``redis.Redis``). Raises ``redis.exceptions.LockError`` when the lock is not had within ``timeout_s``, and what
    ``migrate`` raises."""
    with client.lock(migrate_lock_key(prefix), timeout=timeout_s, blocking_timeout=timeout_s):
        call_command("migrate", interactive=False, verbosity=0)
