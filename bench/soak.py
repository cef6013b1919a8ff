"""Soak (issue 17): ``--minutes`` (default 10) at twice a model's admission capacity, with streaming, non-streaming and
abandoning clients, against ``manage.py serve`` (the drills' platform, harness/drills.py: a private
``redis-server`` on a loopback port, SQLite, the demo model, one api process, ``--mm-api-workers 0``).

The model's capacity is its admission limit: ``max_num_queued_reqs`` = ``--capacity`` (default 4) requests admitted at
once. ``2 × capacity`` closed-loop clients keep sending; each request is, in turn, a stream read to its end, a
non-streamed chat, or a stream abandoned after its first chunk (the client closes the connection). A 503 is followed
by a 100 ms pause (the clients do not spin on refusals; the load stays at twice what is admitted).

Printed per minute: requests, 200s, 503s, their p99 latency (ms, time to the whole refusal), other 5xx (goal 0),
other statuses and transport errors, the resident memory (MiB, each role's whole process tree) of every process of
serve and of Redis, and Redis's ``used_memory``. At the end: each memory's change between minute 2 and the last
minute (goal: within ±10 %), and the worst minute's 503 p99 (issue goal ≤ 50 ms; on the shared 2-core box see
DECISIONS D-163).

    .venv/bin/python bench/soak.py [--minutes 10] [--capacity 4]

Loopback only; the load is bounded by ``--minutes`` and ``2 × --capacity`` clients.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from bench.lib.stats import pct
from harness.assets import DEMO_MODEL
from harness.live_platform import run_manage
from harness.drills import DrillPlatform, start_drill_platform, stop_drill_platform
from harness.serve import child_pids, cmdline

REFUSAL_PAUSE_S = 0.1
ROLES = (("api", ("uvicorn",)), ("render-worker", ("-Q render",)), ("usage-worker", ("-Q usage",)),
         ("mm-worker", ("-Q mm",)), ("beat", ("config beat",)), ("engine", ("inference.engine",)))


@dataclass
class Minute:
    """One minute's figures (see the module docstring)."""

    statuses: dict[str, int] = field(default_factory=dict)
    refusal_ms: list[float] = field(default_factory=list)
    rss_mib: dict[str, float] = field(default_factory=dict)
    redis_used_mib: float = 0.0

    def add(self, status: str, ms: float) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if status == "503":
            self.refusal_ms.append(ms)


def rss_kib(pid: int) -> int:
    """VmRSS of ``pid`` in KiB (0 once it has exited)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(child_pids(p))
    return out


def memory(plat: DrillPlatform) -> tuple[dict[str, float], float]:
    """Resident memory per role (MiB, each role's process tree; ``serve`` itself and ``redis`` too) and Redis's
    ``used_memory`` (MiB)."""
    out: dict[str, float] = {"serve": rss_kib(plat.proc.pid) / 1024, "redis": rss_kib(plat.redis.pid) / 1024}
    for pid in child_pids(plat.proc.pid):
        cmd = cmdline(pid)
        role = next((name for name, marks in ROLES if all(m in cmd for m in marks)), f"pid{pid}")
        out[role] = out.get(role, 0.0) + sum(rss_kib(p) for p in tree(pid)) / 1024
    r = plat.client()
    try:
        used = int(r.info("memory")["used_memory"]) / 2**20
    finally:
        r.close()
    return out, used


async def client_loop(http: httpx.AsyncClient, plat: DrillPlatform, kinds: itertools.cycle, minutes: list[Minute],
                      start: float, end: float) -> None:
    """One closed-loop client until ``end`` (monotonic): requests of the next kind in ``kinds``."""
    headers = {"Authorization": f"Bearer {plat.key}"}
    while time.monotonic() < end:
        kind = next(kinds)
        body = {"model": DEMO_MODEL, "max_tokens": 24 if kind != "plain" else 12, "ignore_eos": True,
                "stream": kind != "plain", "messages": [{"role": "user", "content": "soak: tell me something"}]}
        t0 = time.monotonic()
        status = "?"
        try:
            async with http.stream("POST", f"{plat.base}/v1/chat/completions", json=body, headers=headers) as resp:
                status = str(resp.status_code)
                if resp.status_code != 200 or kind == "plain":
                    await resp.aread()
                elif kind == "abandon":
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            break  # leaving the block closes the connection mid-stream
                else:
                    last, errored = "", False
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            last = line[6:]
                            errored = errored or last.startswith('{"error"')
                    if last != "[DONE]":
                        status = "cut"
                    elif errored:
                        status = "stream-error"
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        ms = (time.monotonic() - t0) * 1000
        idx = int((t0 - start) // 60)
        if idx < len(minutes):
            minutes[idx].add(status, ms)
        if status == "503":
            await asyncio.sleep(REFUSAL_PAUSE_S)


async def drive(plat: DrillPlatform, n_minutes: int, clients: int) -> list[Minute]:
    minutes = [Minute() for _ in range(n_minutes)]
    start = time.monotonic()
    end = start + 60 * n_minutes
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60), limits=limits) as http:
        loops = [asyncio.create_task(client_loop(http, plat, itertools.cycle(
            ["stream", "plain", "abandon"][i % 3:] + ["stream", "plain", "abandon"][:i % 3]), minutes, start, end))
            for i in range(clients)]
        for i in range(n_minutes):
            await asyncio.sleep(max(0.0, start + 60 * (i + 1) - time.monotonic()))
            minutes[i].rss_mib, minutes[i].redis_used_mib = await asyncio.to_thread(memory, plat)
            m = minutes[i]
            print(f"minute {i + 1}: {json.dumps(m.statuses)} 503 p99 {pct(m.refusal_ms, 0.99):.0f} ms", flush=True)
        await asyncio.gather(*loops)
    return minutes


def report(minutes: list[Minute]) -> str:
    roles = sorted({r for m in minutes for r in m.rss_mib})
    head = ["min", "requests", "200", "503", "503 p50 ms", "503 p99 ms", "other 5xx", "other"] + \
        [f"{r} MiB" for r in roles] + ["redis used MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, m in enumerate(minutes, 1):
        s = m.statuses
        other_5xx = sum(v for k, v in s.items() if k.startswith("5") and k != "503")
        other = sum(v for k, v in s.items() if k not in ("200", "503") and not k.startswith("5"))
        cells = [i, sum(s.values()), s.get("200", 0), s.get("503", 0), f"{pct(m.refusal_ms, 0.5):.0f}",
                 f"{pct(m.refusal_ms, 0.99):.0f}", other_5xx, other] + \
            [f"{m.rss_mib.get(r, 0):.0f}" for r in roles] + [f"{m.redis_used_mib:.1f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines.append("")
    if len(minutes) >= 3:
        base = minutes[1]
        drift = []
        for r in roles:
            b = base.rss_mib.get(r, 0)
            if b:
                worst = max((m.rss_mib.get(r, 0) - b) / b for m in minutes[2:]) * 100
                low = min((m.rss_mib.get(r, 0) - b) / b for m in minutes[2:]) * 100
                drift.append(f"{r} {low:+.1f}..{worst:+.1f} %")
        rb = base.redis_used_mib
        if rb:
            drift.append("redis used " + f"{min((m.redis_used_mib - rb) / rb for m in minutes[2:]) * 100:+.1f}.."
                         f"{max((m.redis_used_mib - rb) / rb for m in minutes[2:]) * 100:+.1f} %")
        lines.append("memory vs minute 2 (goal ±10 %): " + "; ".join(drift))
    statuses = {k: sum(m.statuses.get(k, 0) for m in minutes) for m0 in minutes for k in m0.statuses}
    lines.append(f"all statuses: {json.dumps(statuses)}; worst minute's 503 p99: "
                 f"{max(pct(m.refusal_ms, 0.99) for m in minutes):.0f} ms")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=int, default=10, help="soak length in minutes (default 10)")
    ap.add_argument("--capacity", type=int, default=4, help="the model's max_num_queued_reqs; 2× as many clients")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmp-soak-") as tmp:
        t0 = time.monotonic()
        plat = start_drill_platform(Path(tmp))
        try:
            run_manage(plat.env, "admission_policy", DEMO_MODEL, "--max-num-queued-reqs", str(args.capacity),
                       "--max-num-queued-tokens", "none")
            print(f"serve ready in {time.monotonic() - t0:.0f} s; {args.minutes} min at {2 * args.capacity} clients "
                  f"(capacity {args.capacity})", flush=True)
            minutes = asyncio.run(drive(plat, args.minutes, 2 * args.capacity))
            families = key_families(plat)
        finally:
            stop_drill_platform(plat)
    print()
    print(report(minutes))
    print("Redis keys at the end, by family (digits and hex ids as #): " +
          ", ".join(f"{k} {v}" for k, v in families[:8]))
    return 0


def key_families(plat: DrillPlatform) -> list[tuple[str, int]]:
    """Redis keys of the platform grouped by shape (runs of hex digits after a ``:`` or ``-`` as ``#``), most
    numerous first: what Redis memory is made of."""
    import re

    r = plat.client()
    try:
        counts: dict[str, int] = {}
        for key in r.scan_iter(count=1000):
            shape = re.sub(r"(?<=[:\-])[0-9a-f]{4,}", "#", key.decode(errors="replace").replace(plat.prefix, "{p}"))
            counts[shape] = counts.get(shape, 0) + 1
        return sorted(counts.items(), key=lambda kv: -kv[1])
    finally:
        r.close()


if __name__ == "__main__":
    sys.exit(main())
