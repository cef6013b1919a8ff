"""Background responses (issue 41): what running them in the runner process (``manage.py responses_runner``,
``gateway/responses_runner.py``) costs against the same responses in the foreground, and what a Celery worker would
hold instead.

Each round sends ``--requests`` responses ``--clients`` at a time, the same work each way (greedy, ``--max-tokens``
output tokens, stored): foreground (``POST /v1/responses``, answered when done) and background (``background: true,
stream: true``: the accepting api answers at once and tails the response's Redis event stream until its terminal
event). Reported per side: end-to-end latency p50/p99; for background also the hand-off (the ``response.queued``
event to the runner's ``response.in_progress``, as the client sees it); CPU per request of the api process, of the
runner and of the whole platform; and the resident memory of the runner (one process, any number of responses at once,
each an asyncio task) beside one Celery worker process of the platform (``worker-usage``, prefork, Django loaded),
which is what each concurrently running response would hold as a Celery task (a task occupies its worker slot until
it returns, and a response runs for its whole generation).

Usage::

    .venv/bin/python bench/responses_background.py [--requests 60] [--clients 8] [--max-tokens 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from bench.lib.proc_cpu import proc_cpu_s
from bench.lib.stats import pct
from harness.assets import DEMO_MODEL
from harness.live_platform import start_platform

PROMPT = "Request {n}: tell me a story about the sea, with ships, storms and a lighthouse keeper."


def _pids(live) -> dict[str, list[int]]:
    """Process ids by supervisor child name, each with its descendants."""
    out: dict[str, list[int]] = {}
    for child in live.sup.children:
        if child.proc is None:
            continue
        pids = [child.proc.pid]
        try:
            pids += [p.pid for p in psutil.Process(child.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
        out[child.name] = pids
    return out


def _cpu(pids: list[int]) -> float:
    return sum(proc_cpu_s(p) or 0.0 for p in pids)


async def _foreground(client: httpx.AsyncClient, key: str, n: int, max_tokens: int) -> dict[str, float]:
    t0 = time.perf_counter()
    r = await client.post("/v1/responses", headers={"authorization": f"Bearer {key}"}, json={
        "model": DEMO_MODEL, "input": PROMPT.format(n=n), "max_output_tokens": max_tokens, "temperature": 0,
        "reasoning": {"effort": "none"}})
    r.raise_for_status()
    return {"e2e": time.perf_counter() - t0}


async def _background(client: httpx.AsyncClient, key: str, n: int, max_tokens: int) -> dict[str, float]:
    t0 = time.perf_counter()
    seen: dict[str, float] = {}
    async with client.stream("POST", "/v1/responses", headers={"authorization": f"Bearer {key}"}, json={
            "model": DEMO_MODEL, "input": PROMPT.format(n=n), "max_output_tokens": max_tokens, "temperature": 0,
            "reasoning": {"effort": "none"}, "background": True, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                seen.setdefault(line[len("event: "):], time.perf_counter())
    return {"e2e": time.perf_counter() - t0, "handoff": seen["response.in_progress"] - seen["response.queued"]}


async def _load(side: str, client: httpx.AsyncClient, key: str, start: int, requests: int, clients: int,
                max_tokens: int) -> list[dict[str, float]]:
    queue = list(range(start, start + requests))
    out: list[dict[str, float]] = []
    one = _background if side == "background" else _foreground

    async def worker() -> None:
        while queue:
            out.append(await one(client, key, queue.pop(), max_tokens))

    await asyncio.gather(*(worker() for _ in range(clients)))
    return out


async def run(args: argparse.Namespace, live) -> dict[str, dict[str, float]]:
    """Warm-up, then alternating rounds; the figures per side."""
    pids = _pids(live)
    every = [p for group in pids.values() for p in group]
    figures: dict[str, dict[str, list[float]]] = {s: {"e2e": [], "handoff": [], "api": [], "runner": [], "all": []}
                                                  for s in ("foreground", "background")}
    async with httpx.AsyncClient(base_url=live.base_url, timeout=120) as client:
        for side in figures:
            await _load(side, client, live.api_key, 9000, args.clients, args.clients, args.max_tokens)
        for rnd in range(args.rounds):
            for side in (("foreground", "background") if rnd % 2 == 0 else ("background", "foreground")):
                before = (_cpu(pids["api"]), _cpu(pids["responses"]), _cpu(every))
                got = await _load(side, client, live.api_key, 1000 * (rnd + 1) + (500 if side == "background" else 0),
                                  args.requests, args.clients, args.max_tokens)
                after = (_cpu(pids["api"]), _cpu(pids["responses"]), _cpu(every))
                f = figures[side]
                f["e2e"] += [g["e2e"] for g in got]
                f["handoff"] += [g["handoff"] for g in got if "handoff" in g]
                for name, b, a in zip(("api", "runner", "all"), before, after):
                    f[name].append((a - b) / len(got))
    report: dict[str, dict[str, float]] = {}
    for side, f in figures.items():
        report[side] = {"e2e_p50_ms": 1000 * statistics.median(f["e2e"]), "e2e_p99_ms": 1000 * pct(f["e2e"], 0.99),
                        "api_cpu_ms": 1000 * statistics.mean(f["api"]),
                        "runner_cpu_ms": 1000 * statistics.mean(f["runner"]),
                        "all_cpu_ms": 1000 * statistics.mean(f["all"])}
        if f["handoff"]:
            report[side].update(handoff_p50_ms=1000 * statistics.median(f["handoff"]),
                                handoff_p99_ms=1000 * pct(f["handoff"], 0.99))
    rss = {name: sum(psutil.Process(p).memory_info().rss for p in group) / 2**20
           for name, group in pids.items() if name in ("responses", "worker-usage")}
    report["memory_mb"] = {"runner": rss.get("responses", 0.0), "one_celery_worker": rss.get("worker-usage", 0.0)}
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=60, help="responses per side and round")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="responses-background-") as tmp:
        live = start_platform(Path(tmp), max_model_len=512)
        try:
            report = asyncio.run(run(args, live))
        finally:
            live.stop()
    print(json.dumps(report, indent=2))
    print(f"wall {time.monotonic() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
