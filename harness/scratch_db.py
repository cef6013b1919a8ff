"""A PostgreSQL database of its own for each platform a test or benchmark starts, beside the server's ``DATABASE_URL``
database, so no two platforms share rows (tests count records). Copied from a template that has this checkout's
migrations applied, built once per server and migrations digest."""

from __future__ import annotations

import hashlib

from harness import REPO
from harness.manage_runner import runner_for


def migrations_digest() -> str:
    """12 hex digits of a hash of every migration file of this checkout (paths and contents) and Django's version:
    the name of the migrated template database that holds exactly these migrations."""
    import django

    h = hashlib.sha256(django.__version__.encode())
    for path in sorted((REPO / "platform").glob("*/migrations/*.py")):
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def create_scratch_database(url: str, suffix: str, env: dict[str, str] | None = None) -> tuple[str, str, str]:
    """A fresh database beside ``url``'s on the same PostgreSQL server, so a live platform never shares
    rows with another (tests count records). Returns ``(new url, server url, name)``.

    With ``env`` (the platform's environment), the database is a copy of a template that has every migration of
    this checkout applied (``llmp_tpl_<migrations_digest()>``, migrated once per server and kept; templates of other
    migrations are dropped): a platform's own ``migrate`` then has nothing to do, instead of ~5 s of work each."""
    import psycopg

    base, _, _db = url.rpartition("/")
    name = f"llmp_{suffix}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        if env is None:
            conn.execute(f'CREATE DATABASE "{name}"')
        else:
            conn.execute("SELECT pg_advisory_lock(hashtext('llmp migrated template'))")  # one builder per server
            try:
                template = _migrated_template(conn, base, env)
                conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
            finally:
                conn.execute("SELECT pg_advisory_unlock(hashtext('llmp migrated template'))")
    return f"{base}/{name}", url, name


def _migrated_template(conn, base: str, env: dict[str, str]) -> str:
    """The template database's name; built (migrated under a temporary name, then renamed, so a failed build
    leaves no template) when missing. ``conn``: an autocommit connection holding the builder's lock."""
    name = f"llmp_tpl_{migrations_digest()}"
    if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
        return name
    for (old,) in conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'llmp\\_tpl\\_%'").fetchall():
        conn.execute(f'DROP DATABASE IF EXISTS "{old}" WITH (FORCE)')
    building = f"{name}_building"
    conn.execute(f'DROP DATABASE IF EXISTS "{building}" WITH (FORCE)')
    conn.execute(f'CREATE DATABASE "{building}"')
    build_env = dict(env, DATABASE_URL=f"{base}/{building}")
    runner = runner_for(build_env)
    runner.run("migrate", "--no-input", timeout=300)
    runner.close()  # no session may stay connected to a template that is copied
    conn.execute(f'ALTER DATABASE "{building}" RENAME TO "{name}"')
    return name


def drop_scratch_database(server_url: str, name: str) -> None:
    """Drop a database made by ``create_scratch_database`` (connections are closed by force)."""
    import psycopg

    try:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass
