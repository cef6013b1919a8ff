"""Multi-turn ``POST /tokenize`` (chat body): the segment tokenization cache on vs off, in one run (+ vLLM if present).

Each request is the previous request's conversation plus the assistant's reply and one new user turn (every turn
a distinct seeded-random text of about ``--turn-tokens`` tokens), so the history grows to about
``--turns × 2 × turn-tokens`` tokens (default ≈ 8,000), and every body differs. What is compared, request by
request on the same bodies:

* ``inline+cache`` / ``inline-nocache``: two api processes with ``RENDER_ROUTE=inline``, the second with
  ``SEGMENT_CACHE_MAX_TOKENS=0`` (whole-prompt encoding); the requests alternate between them (which one goes
  first alternates too), so both see the same machine load;
* ``celery+cache``, ``celery+local`` then ``celery-nocache``: the default route (Celery ``render`` queue, 2 solo
  workers) with both tiers of the segment cache (per-worker LRU and the workers' shared tier in Redis), then the
  workers restarted with the shared tier off (``SEGMENT_CACHE_REDIS_MIN_CHARS=0``), then with the cache off (same
  bodies, sequential passes; each pass's segment-cache counts are printed);
* ``vllm``: vLLM's CPU server on the same tokenizer, when ``--vllm-python`` imports vllm
  (../shared/reference/peer_vllm.md), interleaved with the inline pair.

Figures: p50/p90 latency (ms) per history size band and overall, CPU ms per request (user+system time of the
server's processes, Celery children included, over the requests), segment-cache hits/misses (the shared
counters behind ``/metrics``), and the ratios cache/no-cache and ours/vLLM. Token ids are checked equal
across every target for every request.

Usage::

    .venv/bin/python bench/multiturn.py [--conversations 3] [--turns 12] [--turn-tokens 330]
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from bench.frontend import start_vllm, stop_vllm
from inference.tasks import segment_cache_counter_key
from ops.supervisor import wait_until
from tests.live_platform import free_port, start_platform

WORDS = ("sea harbour gull tide wave net boat keeper light dawn storm rope sail anchor shell sand reef current "
         "north wind salt fish story morning evening cliff rock foam deep blue green grey calm rough island "
         "the a of and to in on with from over under while because then after before 42 1999 7 "
         "café naïve 東京 🙂 — « » it's they're don't").split()


def turn_text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of seeded-random prose with punctuation and paragraph breaks (distinct per call)."""
    out: list[str] = []
    for i in range(int(tokens * 0.8)):
        out.append(rng.choice(WORDS))
        if i % 13 == 12:
            out[-1] += rng.choice([".", ",", "!", "?", ":\n", ".\n\n"])
    return " ".join(out)


def conversations(n: int, turns: int, turn_tokens: int, seed: int = 7) -> list[list[dict]]:
    """``n`` conversations, each a list of ``turns`` request bodies: body k = history + new user turn k."""
    rng = random.Random(seed)
    convs = []
    for c in range(n):
        msgs = [{"role": "system", "content": f"You are assistant number {c}. " + turn_text(rng, 60)}]
        bodies = []
        for _k in range(turns):
            msgs.append({"role": "user", "content": turn_text(rng, turn_tokens)})
            bodies.append({"model": "tiny-qwen3", "messages": list(msgs), "add_generation_prompt": True})
            msgs.append({"role": "assistant", "content": turn_text(rng, turn_tokens)})
        convs.append(bodies)
    return convs


def tree_cpu(pid: int) -> float:
    """User+system CPU seconds of process ``pid`` and its live descendants."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


class Target:
    """One server under test: URL, auth headers, the pids whose CPU counts, and the per-request results."""

    def __init__(self, name: str, url: str, headers: dict, pids: list[int]) -> None:
        self.name, self.url, self.pids = name, url, pids
        self.client = httpx.Client(base_url=url, headers=headers, timeout=120)
        self.lat: list[tuple[int, float]] = []  # (history tokens, seconds)
        self.cpu = 0.0

    def tokenize(self, body: dict) -> list[int]:
        cpu0 = sum(tree_cpu(p) for p in self.pids)
        t0 = time.perf_counter()
        resp = self.client.post("/tokenize", json=body)
        dt = time.perf_counter() - t0
        self.cpu += sum(tree_cpu(p) for p in self.pids) - cpu0
        assert resp.status_code == 200, (self.name, resp.text[:300])
        ids: list[int] = resp.json()["tokens"]
        self.lat.append((len(ids), dt))
        return ids


def report(targets: list[Target], base: dict[str, str]) -> None:
    bands = [(0, 2000), (2000, 5000), (5000, 10**9)]
    print(f"\n{'target':<16} {'band (tokens)':<14} {'n':>4} {'p50 ms':>8} {'p90 ms':>8} {'CPU ms/req':>10} {'p50 ratio':>22}")
    by_name = {t.name: t for t in targets}
    for t in targets:
        for lo, hi in [*bands, (0, 10**9)]:
            xs = sorted(dt for n, dt in t.lat if lo <= n < hi)
            if not xs:
                continue
            p50, p90 = statistics.median(xs) * 1000, xs[int(len(xs) * 0.9) - (len(xs) >= 10)] * 1000
            label = "all" if (lo, hi) == (0, 10**9) else f"{lo}-{hi if hi < 10**9 else ''}"
            cpu = f"{t.cpu / len(t.lat) * 1000:10.1f}" if label == "all" else " " * 10
            ratio = ""
            ref = by_name.get(base.get(t.name, ""))
            if ref is not None:
                rx = sorted(dt for n, dt in ref.lat if lo <= n < hi)
                if rx:
                    ratio = f"{p50 / (statistics.median(rx) * 1000):.2f}× {ref.name}"
            print(f"{t.name:<16} {label:<14} {len(xs):>4} {p50:>8.1f} {p90:>8.1f} {cpu} {ratio:>22}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--turn-tokens", type=int, default=330)
    ap.add_argument("--vllm-python", default=str(REPO / ".peer" / "vllm" / "bin" / "python"))
    ap.add_argument("--skip-celery", action="store_true")
    args = ap.parse_args()

    convs = conversations(args.conversations, args.turns, args.turn_tokens)
    tmp = Path(tempfile.mkdtemp(prefix="bench-multiturn-"))
    live = start_platform(tmp, max_model_len=32768, engine=False, mm_worker=False)
    vllm = None
    try:
        hdr = {"Authorization": f"Bearer {live.api_key}"}
        on_child, on_url = live.start_api(name="api-inline-on", env_extra={"RENDER_ROUTE": "inline"})
        off_child, off_url = live.start_api(name="api-inline-off", env_extra={"RENDER_ROUTE": "inline",
                                                                               "SEGMENT_CACHE_MAX_TOKENS": "0"})
        assert on_child.proc is not None and off_child.proc is not None
        pair = [Target("inline+cache", on_url, hdr, [on_child.proc.pid]),
                Target("inline-nocache", off_url, hdr, [off_child.proc.pid])]
        if subprocess.run([args.vllm_python, "-c", "import vllm"], capture_output=True).returncode == 0:
            vport = free_port()
            vllm = start_vllm(args.vllm_python, vport, tmp / "vllm.log", max_model_len=32768,
                              ready_timeout_s=900)
            pair.append(Target("vllm", f"http://127.0.0.1:{vport}", {}, [vllm.pid]))
        else:
            print(f"vLLM not importable with {args.vllm_python}: no vLLM baseline in this run")
        r = live.redis
        key = segment_cache_counter_key(live.prefix)
        for t in pair:  # warm-up: tokenizer load, connections (not measured)
            t.tokenize({"model": "tiny-qwen3", "messages": [{"role": "user", "content": "warm up " * 200}]})
            t.lat.clear()
            t.cpu = 0.0
        i = 0
        for bodies in convs:
            for body in bodies:
                order = pair if i % 2 == 0 else pair[::-1]
                ids = [t.tokenize(body) for t in order]
                assert all(x == ids[0] for x in ids), "token ids differ between targets"
                i += 1
        seg = r.hgetall(key)
        inline_hits, inline_misses = int(seg.get(b"hits", 0)), int(seg.get(b"misses", 0))
        targets = list(pair)
        if not args.skip_celery:
            workers = [c for c in live.sup.children if c.name in ("worker", "worker-2")]  # the render workers
            api = next(c for c in live.sup.children if c.name == "api")
            passes = (("celery+cache", {}), ("celery+local", {"SEGMENT_CACHE_REDIS_MIN_CHARS": "0"}),
                      ("celery-nocache", {"SEGMENT_CACHE_MAX_TOKENS": "0"}))
            for name, env in passes:
                seg0 = r.hgetall(key)
                if env:
                    for w in workers:
                        w.env_extra.update(env)
                    workers = [live.sup.restart(w) for w in workers]
                    # every worker warmed (its tokenizers loaded, then idle) before the pass, or it would measure one
                    # worker while the other still loads (the workers log at WARNING: no "ready" line to wait for)
                    procs = [psutil.Process(w.proc.pid) for w in workers if w.proc is not None]
                    time.sleep(2)
                    wait_until(lambda procs=procs: all(p.cpu_percent(interval=0.5) < 5 for p in procs), 180,
                               "restarted render workers to finish warming up", live.sup)
                assert all(w.proc is not None for w in workers) and api.proc is not None
                t = Target(name, live.base_url, hdr, [api.proc.pid, *(w.proc.pid for w in workers if w.proc)])
                wait_until(lambda t=t: t.client.post("/tokenize", json=convs[0][0]).status_code == 200, 120,
                           "render worker", live.sup)
                for _ in range(4):
                    t.tokenize(convs[0][0])
                t.lat.clear()
                t.cpu = 0.0
                for bodies in convs:
                    for body in bodies:
                        t.tokenize(body)
                targets.append(t)
                seg1 = r.hgetall(key)
                print(f"{name}: segment cache {int(seg1.get(b'hits', 0)) - int(seg0.get(b'hits', 0))} hits "
                      f"({int(seg1.get(b'shared_hits', 0)) - int(seg0.get(b'shared_hits', 0))} from the shared tier) / "
                      f"{int(seg1.get(b'misses', 0)) - int(seg0.get(b'misses', 0))} misses (warm-up included)")
        seg = r.hgetall(key)
        print(f"\nmulti-turn /tokenize, Qwen3 tokenizer, {args.conversations} conversations × {args.turns} turns "
              f"(≈{args.turn_tokens} tokens a turn, histories up to "
              f"{max(n for n, _ in pair[0].lat)} tokens); {psutil.cpu_count()} CPUs shared")
        print(f"segment cache (shared counters): inline pair {inline_hits} hits / {inline_misses} misses; "
              f"all {int(seg.get(b'hits', 0))} hits / {int(seg.get(b'misses', 0))} misses")
        report(targets, {"inline+cache": "inline-nocache", "celery+cache": "celery-nocache",
                         "celery+local": "celery-nocache"})
        vt = next((t for t in targets if t.name == "vllm"), None)
        if vt is not None:
            print("\nagainst vLLM:")
            report(targets, {t.name: "vllm" for t in targets if t.name != "vllm"})
    finally:
        if vllm is not None:
            stop_vllm(vllm)
        live.stop()


if __name__ == "__main__":
    main()
