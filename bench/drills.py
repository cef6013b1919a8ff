"""Fault drills (issue 17): ``manage.py serve`` on a private Redis (and a private PostgreSQL cluster where this machine
can make one), one fault per drill during a burst of mixed streaming and non-streaming chats, and a table of what
happened: requests ok / failed cleanly / hung / unclean, admission reservations and key-limit slots held 10 s after the
fault, usage records lost or doubled, seconds until the platform served again. The drills and their definitions are
harness/drills.py; tests/failures/test_drills.py asserts the goals.

    .venv/bin/python bench/drills.py [--requests 16] [--drills api,engine] [--sqlite]

Loopback only; every burst is bounded (``--requests`` chats, each with a 45 s deadline).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from harness.drills import (HANGS, RESTARTS, VICTIMS, PrivatePostgres, run_drill, start_drill_platform,
                            stop_drill_platform, table, usage_check)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16, help="chats per burst (half streamed)")
    ap.add_argument("--drills", default=",".join(VICTIMS + HANGS + RESTARTS),
                    help="comma-separated drills: " + ", ".join(VICTIMS + HANGS + RESTARTS))
    ap.add_argument("--sqlite", action="store_true", help="SQLite even where a private PostgreSQL could be made")
    args = ap.parse_args()
    names = [n for n in args.drills.split(",") if n]
    postgres = not args.sqlite and PrivatePostgres.available()
    if "postgres-restart" in names and not postgres:
        print("postgres-restart skipped: no private PostgreSQL cluster can be made here")
        names.remove("postgres-restart")
    with tempfile.TemporaryDirectory(prefix="llmp-drills-") as tmp:
        t0 = time.monotonic()
        plat = start_drill_platform(Path(tmp), postgres=postgres)
        print(f"serve ready in {time.monotonic() - t0:.0f} s (database: {'PostgreSQL' if postgres else 'SQLite'})",
              flush=True)
        results = []
        try:
            for name in names:
                res = run_drill(plat, name, requests=args.requests)
                results.append(res)
                print(f"{name}: {res.row()}", flush=True)
                for o in res.outcomes:
                    if o.kind != "ok":
                        print(f"    {o.client_id} {'stream' if o.stream else 'plain'} {o.kind} {o.code} "
                              f"after {o.seconds:.1f} s{' (sent after the fault)' if o.after_fault else ''}")
            usage_check(plat, results)
        finally:
            stop_drill_platform(plat)
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
