"""Two ``serve`` processes starting at once on one empty database: both migrate under the Redis lock
(``ops.migrate.migrate_serialized``), neither fails, and every migration is applied once."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from harness import REPO
from harness.scratch_db import create_scratch_database
from tests.support.redis import TEST_REDIS_URL, fresh_prefix

MIGRATE = ("import django, redis, sys; django.setup(); from ops.migrate import migrate_serialized; "
           "migrate_serialized(redis.Redis.from_url(sys.argv[1]), sys.argv[2])")


@pytest.fixture
def empty_database(tmp_path):
    """``DATABASE_URL`` of an empty database: a scratch one on the PostgreSQL server of ``DATABASE_URL`` (the
    multi-host case), else a new SQLite file."""
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        yield f"sqlite:///{tmp_path / 'db.sqlite3'}"
        return
    import psycopg

    new_url, server_url, name = create_scratch_database(url, f"mig{uuid.uuid4().hex[:8]}")
    try:
        yield new_url
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_two_serves_migrate_one_empty_database_at_once(empty_database, tmp_path):
    env = dict(os.environ, DATABASE_URL=empty_database, DJANGO_SETTINGS_MODULE="config.settings",
               PYTHONPATH=os.pathsep.join([str(REPO / "platform"), str(REPO)]), LLMP_VAR_DIR=str(tmp_path / "var"))
    with fresh_prefix("miglock") as prefix:
        procs = [subprocess.Popen([sys.executable, "-c", MIGRATE, TEST_REDIS_URL, prefix], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
        outs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
    check = subprocess.run([sys.executable, "manage.py", "migrate", "--check"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr  # nothing left unapplied
