"""Operator dashboard at scale (issue 17): p50/p95 of the page and of its JSON with 100,000 keys and 1,000,000 usage
records (harness/usage_scale.py builds them: heavy keys with known ranks, the rest spread evenly, one record in
ten in the last hour, the rest over 28 days).

Requests go through Django's test client in this process (URL routing, middleware, session auth, the view,
template rendering, JSON encoding; no socket), logged in as a superuser. Cases: each range's first page; a page
deep in the table; a search by tenant name, by key prefix; one tenant; one model (the live query, D-158); the page
itself. Goal: p95 < 1 s each. The last column says where the key ranking came from (``keys.source``: the per-key
range totals or the live query). ``--keep-db`` keeps PostgreSQL's scratch database for ``EXPLAIN``.

Usage::

    .venv/bin/python bench/dashboard_scale.py [--keys 100000] [--records 1000000] [--rounds 21]
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/dashboard_scale.py

SQLite (default): a scratch file in a temporary folder. PostgreSQL (``DATABASE_URL``): a scratch database
``bench_dash_<pid>`` beside it, dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "platform"), str(REPO)]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _scratch_pg(url: str) -> tuple[str, str]:
    import psycopg

    name = f"bench_dash_{os.getpid()}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{url.rsplit('/', 1)[0]}/{name}", name


def _drop_pg(url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--tenants", type=int, default=1_000)
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--keep-db", action="store_true", help="PostgreSQL: keep the scratch database (drop it yourself)")
    args = ap.parse_args()
    base_url = os.environ.get("DATABASE_URL", "")
    scratch = None
    tmp = tempfile.TemporaryDirectory(prefix="bench-dash-")
    if base_url.startswith("postgres"):
        url, name = _scratch_pg(base_url)
        scratch = (base_url, name)
    else:
        url = f"sqlite:///{tmp.name}/db.sqlite3"
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/15")  # settings need one; nothing is sent
    os.environ["LINK_PREFIX"] = f"benchdash{uuid.uuid4().hex[:8]}"
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    try:
        import django

        django.setup()
        from django.conf import settings
        from django.contrib.auth import get_user_model
        from django.core.management import call_command
        from django.db import connection
        from django.test import Client

        from harness.usage_scale import build_usage_at_scale

        settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
        call_command("migrate", verbosity=0)
        print(f"== building {args.keys:,} keys ({args.tenants:,} tenants), {args.records:,} records "
              f"on {connection.vendor}")
        data = build_usage_at_scale(keys=args.keys, tenants=args.tenants, records=args.records)
        print("   " + ", ".join(f"{k} {v:.1f} s" for k, v in data.seconds.items()))
        from usage.models import UsageRollup, UsageTotal

        print(f"   rollup rows: {UsageRollup.objects.count():,}; total rows: {UsageTotal.objects.count():,}")
        client = Client()
        client.force_login(get_user_model().objects.create_superuser("bench", "b@example.com", "pw-bench-123"))
        pages = args.keys // 50
        cases = [
            ("data 30d, page 1", "/admin/usage-data", {"range": "30d"}),
            ("data day, page 1", "/admin/usage-data", {"range": "day"}),
            ("data hour, page 1", "/admin/usage-data", {"range": "hour"}),
            (f"data 30d, page {pages // 2}", "/admin/usage-data", {"range": "30d", "page": pages // 2}),
            ("data 30d, search tenant", "/admin/usage-data", {"range": "30d", "q": "scale-tenant-00007"}),
            ("data 30d, search prefix", "/admin/usage-data", {"range": "30d", "q": "sk-N00420"}),
            ("data 30d, one tenant", "/admin/usage-data", {"range": "30d", "tenant": data.tenant_ids[3]}),
            ("data 30d, one model", "/admin/usage-data", {"range": "30d", "model": "all-MiniLM-L6-v2"}),
            ("data hour, one key", "/admin/usage-data", {"range": "hour", "api_key_id": data.key_ids[0]}),
            ("page 30d", "/admin/usage/usagerollup/", {"range": "30d"}),
            ("page hour", "/admin/usage/usagerollup/", {"range": "hour"}),
            ("page day, search", "/admin/usage/usagerollup/", {"range": "day", "q": "svc-0001"}),
        ]
        print(f"\n{'case':32} {'p50 ms':>9} {'p95 ms':>9} {'bytes':>9}  key ranking")
        worst = 0.0
        for label, path, params in cases:
            times = []
            size = 0
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                r = client.get(path, params)
                times.append((time.perf_counter() - t0) * 1000)
                assert r.status_code == 200, (label, r.status_code, r.content[:300])
                size = len(r.content)
                source = r.json()["keys"].get("source", "?") if path.endswith("-data") else "(page)"
            p95 = _pct(times, 0.95)
            worst = max(worst, p95)
            print(f"{label:32} {statistics.median(times):9.1f} {p95:9.1f} {size:9,}  {source}")
        print(f"\nworst p95: {worst:.1f} ms   (goal < 1000 ms)")
    finally:
        from django.db import connections

        connections.close_all()
        if scratch is not None and args.keep_db:
            print(f"kept database {scratch[1]}")
        elif scratch is not None:
            _drop_pg(*scratch)
        tmp.cleanup()


if __name__ == "__main__":
    main()
