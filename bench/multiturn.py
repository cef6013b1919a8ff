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
  (``scripts/setup.sh --vllm``), interleaved with the inline pair.

With ``--ttft``, the same conversations are also sent as streaming chats (``max_tokens`` 4, ``ignore_eos``) and
time to first token is compared, request by request: ``ttft-celery`` (the default route) and ``ttft-inline`` through
the platform to a native engine replica started as ``manage.py serve`` starts one (the cores less one for the
frontend, niceness 10), and ``ttft-vllm``, vLLM's server on its own engine; both engines in float32, prefix caching
on (each turn's history was the previous turn's prompt), neither with a reasoning parser. After every vLLM request
the next one waits ``bench.lib.vllm_server.IDLE_GAP_S``: vLLM's engine spins for a second after its last step. Each of
the two routes uses a key of a tenant of its own, so neither finds the other's prompt in the engine's prefix cache
(nor anything of the ``/tokenize`` passes in the segment cache).

Figures: p50/p90 latency (ms) per history size band and overall, CPU ms per request (user+system time of the
server's processes, Celery children included, over the requests), segment-cache hits/misses (the shared
counters behind ``/metrics``), and the ratios cache/no-cache and ours/vLLM. Token ids are checked equal
across every target for every request.

Usage::

    .venv/bin/python bench/multiturn.py [--conversations 3] [--turns 12] [--turn-tokens 330] [--ttft]
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
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from bench.lib.vllm_server import IDLE_GAP_S, start_vllm, stop_vllm
from inference.workers.tasks import segment_cache_counter_key
from ops.supervisor import wait_until
from harness.assets import MODEL_DIR
from harness.live_platform import free_port, start_platform

TTFT_MODEL = "tiny-qwen3-ttft"  # the demo model registered for the --ttft pass (float32, no reasoning parser)
PHASES = ("frontend", "queue", "prefill")  # TTFT's phases in /metrics (gateway.endpoints.metrics.PHASE_HELP)

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

    def ttft(self, body: dict, model: str, prompt_tokens: int) -> None:
        """Stream ``body`` as a chat completion on ``model`` (4 tokens, EOS ignored, greedy) and record the time to
        the first chunk with content (s) against ``prompt_tokens``; the CPU of ``pids`` over the request is added."""
        req = {**body, "model": model, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
        cpu0 = sum(tree_cpu(p) for p in self.pids)
        t0 = time.perf_counter()
        first = None
        with self.client.stream("POST", "/v1/chat/completions", json=req) as resp:
            assert resp.status_code == 200, (self.name, resp.read()[:300])
            lines = []
            for line in resp.iter_lines():
                lines.append(line)
                if first is None and line.startswith("data: {") and '"content":"' in line \
                        and '"content":""' not in line:
                    first = time.perf_counter() - t0
        self.cpu += sum(tree_cpu(p) for p in self.pids) - cpu0
        assert first is not None, f"{self.name}: no content in the stream: {lines[-6:]}"
        self.lat.append((prompt_tokens, first))


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


def phase_sums(live, key: str) -> dict[str, tuple[float, float]]:
    """``{phase: (sum s, count)}`` of ``TTFT_MODEL``'s TTFT histogram and its phases (frontend, queue, prefill) from
    the platform's ``/metrics`` (``key``: an operator key)."""
    text = httpx.get(f"{live.base_url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
    out: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("time_to_first_token_seconds", *(f"request_{p}_time_seconds" for p in PHASES)):
            got = {s.name.rsplit("_", 1)[1]: s.value for s in family.samples
                   if s.labels.get("model") == TTFT_MODEL and s.name.endswith(("_sum", "_count"))}
            out[family.name] = (got.get("sum", 0.0), got.get("count", 0.0))
    return out


def ttft_pass(live, convs: list[list[dict]], sizes: list[int], inline_url: str, inline_pid: int,
              vllm: Target | None) -> tuple[list[Target], str]:
    """``--ttft``: register ``TTFT_MODEL`` (the demo model, float32, no reasoning parser), start one native replica as
    ``serve`` does, and stream every body of ``convs`` through the platform's default route, its inline api
    (``inline_url``) and, when ``vllm`` (vLLM's ``/tokenize`` target) is given, vLLM's server; returns the targets
    (latency = time to first content, against ``sizes``: the prompts' tokens, in the order of ``convs``, from the
    ``/tokenize`` passes, so that nothing here encodes a prompt before it is sent), and a line with the platform's
    mean TTFT and its phases over the pass (``/metrics``)."""
    live.manage("register_model", TTFT_MODEL, str(MODEL_DIR), "--max-model-len", "32768", "--dtype", "float32",
                "--reasoning-parser", "none")
    engine = live.start_engine("engine-ttft", model=TTFT_MODEL, extra_args=("--dtype", "float32"), serve_layout=True)
    # a tenant per target: its own cache scope (segment cache and the engine's prefix cache), so that neither route
    # finds the prompt the other just sent, and each sees what vLLM sees: the history cached, the new turn not
    hdr = {name: {"Authorization": f"Bearer {live.new_key(tenant=f'multiturn-{name}')}"} for name in ("celery", "inline")}
    api = next(c for c in live.sup.children if c.name == "api")
    workers = [c.proc.pid for c in live.sup.children if c.name in ("worker", "worker-2") and c.proc]
    assert api.proc is not None and engine.proc is not None
    ours = [Target("ttft-celery", live.base_url, hdr["celery"], [api.proc.pid, *workers, engine.proc.pid]),
            Target("ttft-inline", inline_url, hdr["inline"], [inline_pid, engine.proc.pid])]
    targets = [*ours, Target("ttft-vllm", vllm.url, {}, vllm.pids)] if vllm else ours
    model = {t.name: TTFT_MODEL for t in ours} | {"ttft-vllm": "tiny-qwen3"}  # vLLM serves the demo model's name
    warm = {"messages": [{"role": "user", "content": "warm up " * 200}]}
    for t in targets:
        for _ in range(2):
            t.ttft(warm, model[t.name], 0)
        t.lat.clear()
        t.cpu = 0.0
    time.sleep(IDLE_GAP_S)
    ops = live.new_key(tenant="multiturn-ops", scopes="operator")
    before = phase_sums(live, ops)
    for i, (body, n) in enumerate(zip([b for bodies in convs for b in bodies], sizes, strict=True)):
        for t in targets if i % 2 == 0 else targets[::-1]:
            t.ttft(body, model[t.name], n)
            if t.name == "ttft-vllm":
                time.sleep(IDLE_GAP_S)  # vLLM's engine spins for a second after its last step
    after = phase_sums(live, ops)
    means = {name: (after[name][0] - before[name][0]) / max(1.0, after[name][1] - before[name][1]) * 1000
             for name in after}
    phases = ", ".join(f"{p} {means.get(f'request_{p}_time_seconds', 0):.1f} ms" for p in PHASES)
    return targets, (f"platform's TTFT, both routes, mean per request from /metrics: "
                     f"{means.get('time_to_first_token_seconds', 0):.1f} ms, of which {phases} (the rest: the engine "
                     "link both ways)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--turn-tokens", type=int, default=330)
    ap.add_argument("--vllm-python", default=str(REPO / ".peer" / "vllm" / "bin" / "python"))
    ap.add_argument("--skip-celery", action="store_true")
    ap.add_argument("--ttft", action="store_true",
                    help="also time to first token of the same conversations as streaming chats, on a native engine "
                         "through the platform (Celery and inline routes) and on vLLM's server")
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
        if Path(args.vllm_python).exists() and \
                subprocess.run([args.vllm_python, "-c", "import vllm"], capture_output=True).returncode == 0:
            vport = free_port()
            vllm = start_vllm(args.vllm_python, vport, tmp / "vllm.log", max_model_len=32768,
                              ready_timeout_s=900, dtype="float32")
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
        sizes = [n for n, _ in pair[0].lat]  # every body's prompt tokens, in order
        ttft_targets, phases = ttft_pass(live, convs, sizes, on_url, on_child.proc.pid,
                                         pair[-1] if vllm is not None else None) if args.ttft else ([], "")
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
        if ttft_targets:
            print("\ntime to first token, streaming chats of the same conversations (4 tokens each; CPU of the "
                  "api, render workers and engine, or vLLM's api server and engine):")
            report(ttft_targets, {t.name: "ttft-vllm" for t in ttft_targets if t.name != "ttft-vllm"})
            print(phases)
    finally:
        if vllm is not None:
            stop_vllm(vllm)
        live.stop()


if __name__ == "__main__":
    main()
