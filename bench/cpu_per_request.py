"""CPU time per request, per server process: ``POST /tokenize`` (chat body) on this platform vs vLLM's api server.

What it measures: the CPU (user + system time, ``/proc/<pid>/stat``) that every process of each server spends per
request, read before and after a bounded load of ``--requests`` calls with ``--clients`` concurrent clients.
Every body is distinct (the request's number is in its last message), so no cache of whole prompts serves a
repeat. The platform runs its default route (Celery ``render`` queue: two solo workers, as
``harness.live_platform.start_platform`` starts it, without engines; or, with ``--serve``, as ``manage.py serve --demo``
lays it out) with its own embedded Redis, so Redis's CPU is counted too
(``REDIS_URL`` and ``DATABASE_URL`` of the environment are ignored: a shared Redis's or PostgreSQL's CPU cannot be
attributed); every process of it counts: api, render worker and its pool children, usage and mm workers and
theirs, beat, Redis. vLLM's CPU server (``.peer/vllm``: ``scripts/setup.sh --vllm``) counts its api server
and every descendant (its engine core). The two servers are loaded one after the other, never at once, in
``--rounds`` alternating rounds (their sums are reported), in the same run, after the same warm-up. Both are checked
to return identical token ids first.

The CPU each process burns while idle (beats, heartbeats, polling) is measured too, over ``--idle-seconds`` before
the load, and printed as ms per second beside the per-request figures: it is included in them (the load's wall
time × that rate), not subtracted.

Usage::

    .venv/bin/python bench/cpu_per_request.py [--requests 1000] [--clients 8] [--tokens 1000] [--rounds 2]
        [--max-seconds 300] [--vllm-python .peer/vllm/bin/python] [--no-vllm] [--json out.json]
        [--py-spy /tmp/pyspy-venv/bin/py-spy --profile-dir DIR] [--serve | --serve=--no-engine]

With ``--py-spy`` (a py-spy executable; keep it out of the project's environment), one more platform round runs
after the measured ones, unmeasured, with py-spy sampling the api process and the render worker and its pool children
(samples of threads holding the GIL: Python on a CPU; function level): their collapsed stacks go to ``--profile-dir`` and the functions with the
most samples, inclusive and own, are printed per process.

Loopback only. Bounded: each round stops issuing requests after ``--max-seconds`` (CPU is then divided by the
requests answered).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import shlex
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from bench.lib.proc_cpu import describe, proc_cpu_s
from bench.lib.tokenize_bodies import chat_body, first_tokens
from bench.lib.vllm_server import start_vllm, stop_vllm
from harness.live_platform import free_port, start_platform


@dataclass
class Server:
    """One server under test: base URL, auth headers, and its root processes as ``(label, pid)``; the processes
    that count are these and all their descendants, found afresh at each snapshot."""

    name: str
    url: str
    headers: dict[str, str]
    roots: list[tuple[str, int]]
    cpu: dict[str, float] = field(default_factory=dict)  # label -> CPU s over the measured loads
    idle: dict[str, float] = field(default_factory=dict)  # label -> CPU s per s while idle
    done: int = 0
    errors: int = 0
    wall: float = 0.0
    lat: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def processes(self) -> dict[str, int]:
        """label -> pid of every process now: roots by their label, descendants as ``root/name[#n]``."""
        out: dict[str, int] = {}
        for label, pid in self.roots:
            try:
                root = psutil.Process(pid)
                kids = root.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            out[label] = pid
            for kid in sorted(kids, key=lambda p: p.pid):
                try:
                    base = f"{label}/{describe(kid)}"
                except psutil.NoSuchProcess:
                    continue
                name, n = base, 1
                while name in out:
                    n += 1
                    name = f"{base}#{n}"
                out[name] = kid.pid
        return out

    def snapshot(self) -> dict[str, tuple[int, float]]:
        """label -> (pid, CPU seconds) of every process now."""
        snap = {}
        for label, pid in self.processes().items():
            cpu = proc_cpu_s(pid)
            if cpu is not None:
                snap[label] = (pid, cpu)
        return snap

    def add(self, before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]],
            into: dict[str, float], scale: float = 1.0) -> None:
        """Add the CPU each process spent between two snapshots (times ``scale``) to ``into``; a process that
        appeared, went away or changed pid in between is noted (its CPU before or after is lost)."""
        for label, (pid, cpu) in after.items():
            old = before.get(label)
            if old is None or old[0] != pid:
                self.notes.append(f"{label} (pid {pid}) started during a measurement")
                continue
            into[label] = into.get(label, 0.0) + (cpu - old[1]) * scale
        for label in before.keys() - after.keys():
            self.notes.append(f"{label} (pid {before[label][0]}) ended during a measurement")


def body_bytes(template: dict, i: int) -> bytes:
    """``template`` with the request number in its last message, as JSON bytes."""
    msgs = [*template["messages"][:-1], {**template["messages"][-1],
                                         "content": f"{template['messages'][-1]['content']} (request {i})"}]
    return json.dumps({**template, "messages": msgs}).encode()


async def load(server: Server, bodies: list[bytes], clients: int, max_seconds: float) -> None:
    """Send ``bodies`` to ``server``'s ``/tokenize`` with ``clients`` in flight, stopping after ``max_seconds``;
    adds answered requests, errors, wall time and latencies to ``server``."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    headers = {**server.headers, "content-type": "application/json"}
    todo = iter(bodies)
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits, headers=headers) as client:
        deadline = time.monotonic() + max_seconds

        async def worker() -> None:
            for body in todo:
                if time.monotonic() > deadline:
                    return
                t0 = time.perf_counter()
                resp = await client.post("/tokenize", content=body)
                server.lat.append(time.perf_counter() - t0)
                server.done += 1
                if resp.status_code != 200:
                    server.errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        server.wall += time.perf_counter() - t0


def measure_idle(server: Server, seconds: float) -> None:
    """CPU per second of each of ``server``'s processes while no request is served."""
    before = server.snapshot()
    time.sleep(seconds)
    server.add(before, server.snapshot(), server.idle, 1.0 / seconds)


def warm(server: Server, template: dict, clients: int, n: int) -> None:
    """``n`` unmeasured requests (connections, every render child's tokenizer and template)."""
    bodies = [body_bytes(template, -1 - i) for i in range(n)]
    asyncio.run(load(server, bodies, clients, 120))
    server.done = server.errors = 0
    server.wall = 0.0
    server.lat.clear()


def profiled(label: str) -> bool:
    """True for the processes ``profile_round`` samples: api processes and render workers with their children."""
    parts = label.split("/")
    render_worker = parts[0] == "worker" or (parts[0].startswith("worker-") and parts[0][7:].isdigit())
    return parts[-1] == "api" or parts[-1].startswith("celery worker -Q render") or render_worker


def profile_round(server: Server, bodies: list[bytes], clients: int, max_seconds: float, py_spy: str,
                  out_dir: Path) -> list[Path]:
    """One unmeasured load of ``server`` with ``py-spy record`` attached to every ``profiled`` process (the api,
    the render workers and their children); returns the collapsed-stack files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spies = []
    for label, pid in server.processes().items():
        if profiled(label):
            path = out_dir / (label.replace("/", "_").replace("#", "_").replace(" ", "") + ".txt")
            spies.append((path, subprocess.Popen([py_spy, "record", "-p", str(pid), "-r", "200", "-f", "raw", "--gil",
                                                  "--nolineno", "-o", str(path)],
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    time.sleep(1)  # attached
    try:
        asyncio.run(load(server, bodies, clients, max_seconds))
    finally:
        for _path, spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        for _path, spy in spies:
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
    return [path for path, _spy in spies if path.is_file()]


def top_functions(path: Path, n: int = 25) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    """``(samples, inclusive, own)`` of a collapsed-stack file (``frame;frame;... count`` per line): the ``n``
    functions with the most samples anywhere in the stack (each counted once per stack) and at its top."""
    total, incl, own = 0, Counter[str](), Counter[str]()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        total += int(count)
        own[frames[-1]] += int(count)
        for f in set(frames):
            incl[f] += int(count)
    return total, incl.most_common(n), own.most_common(n)


def print_profile(paths: list[Path], n: int = 25) -> None:
    """The ``top_functions`` of each file, as percentages of its samples."""
    for path in paths:
        total, incl, own = top_functions(path, n)
        if not total:
            continue
        print(f"\nprofile {path.name}: {total} on-CPU samples")
        for title, rows in (("inclusive", incl), ("own", own)):
            print(f"  {title}:")
            for fn, c in rows:
                print(f"    {c / total * 100:5.1f}%  {fn[:150]}")


def report(servers: list[Server]) -> dict:
    """Print the per-process table and totals; returns them as a dict (``--json``)."""
    out: dict = {}
    for s in servers:
        n = max(1, s.done)
        rows = sorted(s.cpu.items(), key=lambda kv: -kv[1])
        total = sum(s.cpu.values())
        lat = sorted(s.lat)
        p50 = statistics.median(lat) * 1000 if lat else 0.0
        print(f"\n{s.name}: {s.done} requests ({s.errors} errors), {s.done / s.wall if s.wall else 0:.0f} req/s, "
              f"p50 {p50:.1f} ms")
        print(f"  {'process':<44} {'CPU ms/req':>10} {'idle ms/s':>10}")
        for label, cpu in rows:
            print(f"  {label:<44} {cpu / n * 1000:>10.3f} {s.idle.get(label, 0.0) * 1000:>10.2f}")
        print(f"  {'total (' + str(len(rows)) + ' processes)':<44} {total / n * 1000:>10.3f} "
              f"{sum(s.idle.values()) * 1000:>10.2f}")
        for note in dict.fromkeys(s.notes):
            print(f"  note: {note}")
        out[s.name] = {"requests": s.done, "errors": s.errors, "rps": s.done / s.wall if s.wall else 0.0,
                       "p50_ms": p50, "cpu_ms_per_req": {k: v / n * 1000 for k, v in rows},
                       "total_cpu_ms_per_req": total / n * 1000,
                       "idle_ms_per_s": {k: v * 1000 for k, v in s.idle.items()}}
    if len(servers) == 2 and all(s.done for s in servers):
        a, b = (out[s.name]["total_cpu_ms_per_req"] for s in servers)
        print(f"\nCPU per request {servers[0].name}/{servers[1].name}: {a / b:.2f}x")
        out["ratio"] = a / b
    return out


def start_serve(tmp: Path, serve_args: str) -> tuple[Server, Callable[[], None]]:
    """``manage.py serve --demo SERVE_ARGS`` (its own embedded Redis, SQLite, var/ in ``tmp``) as the platform: every
    process under serve counts (serve itself included); returns the server and how to stop it."""
    from harness.serve import banner_key, serve_banner, serve_env, stop_serve

    env = serve_env(tmp)
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "manage.py"), "serve", "--demo", "--port", str(port),
                             *shlex.split(serve_args)], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        key = banner_key(serve_banner(proc.stdout, 900))
    except BaseException:
        stop_serve(proc)
        raise
    return (Server("platform", f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}, [("serve", proc.pid)]),
            lambda: stop_serve(proc))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000, help="measured requests per server per round")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1000, help="about this many tokens per chat body")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (platform, vLLM, platform, ...)")
    ap.add_argument("--max-seconds", type=float, default=300, help="per server per round")
    ap.add_argument("--idle-seconds", type=float, default=5)
    ap.add_argument("--render-pool", choices=("solo", "prefork"), default="solo",
                    help="the render workers' Celery pool: solo (two workers, serve's default) or prefork (one worker, "
                         "two children; DECISIONS D-296)")
    ap.add_argument("--vllm-python", default=str(REPO / ".peer" / "vllm" / "bin" / "python"))
    ap.add_argument("--no-vllm", action="store_true", help="the platform only")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument("--serve", nargs="?", const="", default=None, metavar="ARGS",
                    help="the platform as `manage.py serve --demo ARGS` lays it out (quickstart's layout: two render "
                         "workers, the multimodal api behind the front one, engines unless ARGS has --no-engine)")
    ap.add_argument("--py-spy", help="a py-spy executable: profile one more (unmeasured) platform round")
    ap.add_argument("--profile-dir", type=Path, help="where the collapsed stacks go (default: the run's temp dir)")
    args = ap.parse_args()

    for var in ("REDIS_URL", "DATABASE_URL", "RENDER_ROUTE"):  # own Redis (counted), SQLite, the default route
        os.environ.pop(var, None)
    tmp = Path(tempfile.mkdtemp(prefix="bench-cpu-"))
    if args.serve is not None:
        platform, stop_platform = start_serve(tmp, args.serve)
    else:
        live = start_platform(tmp, max_model_len=4096, engine=False, render_pool=args.render_pool)
        stop_platform = live.stop
        platform = Server("platform", live.base_url, {"Authorization": f"Bearer {live.api_key}"},
                          [(c.name, c.proc.pid) for c in live.sup.children if c.proc is not None])
    vllm = None
    try:
        servers = [platform]
        if not args.no_vllm:
            vport = free_port()
            vllm = start_vllm(args.vllm_python, vport, tmp / "vllm.log")
            servers.append(Server("vllm", f"http://127.0.0.1:{vport}", {}, [("vllm api", vllm.pid)]))
        template = {"model": "tiny-qwen3", **chat_body(args.tokens)}
        probe = json.loads(body_bytes(template, 0))
        ids = {s.name: first_tokens(s.url, s.headers, probe) for s in servers}
        assert len({tuple(v) for v in ids.values()}) == 1, "token ids differ between servers"
        for s in servers:
            warm(s, template, args.clients, 4 * args.clients)
        for s in servers:
            measure_idle(s, args.idle_seconds)
        for r in range(args.rounds):
            bodies = [body_bytes(template, r * args.requests + i) for i in range(args.requests)]
            for s in servers:
                before = s.snapshot()
                asyncio.run(load(s, bodies, args.clients, args.max_seconds))
                s.add(before, s.snapshot(), s.cpu)
        print(f"\n/tokenize chat body, {len(ids[servers[0].name])} tokens (+ request number), {args.clients} clients, "
              f"{args.rounds} round(s) of {args.requests}; {os.cpu_count()} CPUs shared; CPU from /proc/<pid>/stat")
        figures = report(servers)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1))
        if args.py_spy:
            bodies = [body_bytes(template, args.rounds * args.requests + i) for i in range(args.requests)]
            print_profile(profile_round(servers[0], bodies, args.clients, args.max_seconds, args.py_spy,
                                        args.profile_dir or tmp / "profile"))
    finally:
        if vllm is not None:
            stop_vllm(vllm)
        stop_platform()


if __name__ == "__main__":
    main()
