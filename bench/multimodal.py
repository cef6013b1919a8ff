"""Multimodal + embeddings benchmark (issue 6). Starts a live platform (harness/live_platform.py) with the
demo Qwen2-VL model, an ``mm`` worker and an all-MiniLM-L6-v2 pooling engine, then prints:

1. p50/p99 latency of text ``/tokenize`` requests alone, and while 8 clients send image chat requests
   continuously (goal: ratio ≤ 1.2), in ``--rounds`` alternating alone/loaded windows of ``--seconds`` (the image
   clients paused and drained for the alone windows), so drift of the machine's speed falls on both figures alike.
   The image clients run in their own process and post request bodies built before the run (distinct random
   400x300 PNGs: every one is a cache miss), so the measuring client's timings include no image encoding and no
   GIL wait behind them; every client keeps its HTTP connection alive between requests, as the official
   ``openai`` client does;
2. time of the second identical image request vs the first (goal: ≥ 10× faster), median of 3 images of
   1200x900: with the demo model's processor (at most 64 image tokens, the test setting) and with the same
   model behind Qwen2-VL's usual serving cap of 1280 image tokens (``max_pixels = 1280·28²``; the
   1200x900 image becomes 1,252 prompt tokens), where the first request's preprocessing, vision tower and
   prefill are what a real deployment pays; the repeat skips the mm queue (api-side cache hit), the vision
   tower (encoder cache) and the prefill (prefix cache), and prints how many prompt tokens it reused;
3. embeddings throughput (inputs/s at batch 32) via /v1/embeddings vs the model run directly (goal ≥ 0.8×),
   the request as the official ``openai`` client sends it (``encoding_format: base64``) and the vectors decoded:
   with 2 concurrent clients (a throughput figure: the engine never waits for the next request's HTTP,
   JSON and tokenizing) and with one client at a time (every request's full latency in the figure).

Before part 1, concurrent image chats and tokenize calls warm every render worker child.

The platform runs as ``manage.py serve`` lays it out: the front api relays image chats to a multimodal api process
over a unix socket (gateway/handoff.py; ``--mm-api-workers 0`` turns the multimodal api off). For part 1 it is
also pinned as ``serve --frontend-cores 0`` pins it (on two cores or more; ``--frontend-cores ""`` turns that
off): the front api alone on the frontend core, with the measuring client (it stands for users elsewhere; on one
box it has to run somewhere), and the engines, workers, multimodal api, embedded Redis and image clients on the other cores.
Parts 2 and 3 run unpinned, as ``serve`` runs by default.
Pinning an external Redis (``REDIS_URL``) is left to its operator: the bench says so when it cannot pin it.

Usage: ``python bench/multimodal.py [--seconds 10] [--parts 1,2,3] [--frontend-cores 0] [--mm-api-workers 1]
[--engine-threads N] [--engine-nice N] [--client-nice N]`` (``REDIS_URL=...`` uses that
Redis instead of an embedded one).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import http.client
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from harness.minilm_reference import DirectMiniLM
from harness.assets import minilm_dir, VL_DIR, VL_MODEL, ensure_vl_model
from ops.supervisor import parse_cpu_list, unix_socket_accepts, wait_until
from harness.live_platform import start_platform
from harness.images import data_url, image_bytes

BIG_MODEL = "tiny-vl-1280"


def post(base, key, path, body, timeout=120):
    """POST ``body`` (a dict, or bytes already serialized) and return the decoded JSON answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{path}: HTTP {exc.code}: {exc.read()[:500]!r}") from None


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def capped_model_dir(max_image_tokens: int) -> Path:
    """The demo VL model with its processor's ``max_pixels`` set to ``max_image_tokens·28²`` (a sibling
    directory of hard links to the same weights and tokenizer, only ``preprocessor_config.json`` differs)."""
    out = VL_DIR.parent / f"{VL_DIR.name}-{max_image_tokens}"
    out.mkdir(exist_ok=True)
    for f in VL_DIR.iterdir():
        if f.name != "preprocessor_config.json" and not (out / f.name).exists():
            (out / f.name).hardlink_to(f)
    cfg = json.loads((VL_DIR / "preprocessor_config.json").read_text())
    cfg["size"]["longest_edge"] = max_image_tokens * 28 * 28
    (out / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2))
    return out


def keep_alive_poster(base_url: str, key: str, timeout: float):
    """``(post, close)`` over one keep-alive connection to ``base_url`` (as the official ``openai`` client and any
    pooled HTTP client send requests): ``post(path, body_bytes)`` returns the response body, raises on non-200."""
    parts = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}

    def post_body(path: str, body: bytes) -> bytes:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{path}: HTTP {resp.status}: {data[:300]!r}")
        return data

    return post_body, conn.close


def tokenize_load(live, seconds):
    """Back-to-back text ``/tokenize`` calls for ``seconds`` on one keep-alive connection; returns the latencies
    in seconds."""
    lat = []
    post_body, close = keep_alive_poster(live.base_url, live.api_key, 60)
    body = json.dumps({"model": VL_MODEL, "prompt": "hello world " * 20}).encode()
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            json.loads(post_body("/tokenize", body))
            lat.append(time.perf_counter() - t0)
    finally:
        close()
    return lat


def image_load(base_url: str, key: str, bodies: list[bytes], clients: int, running, stop, inflight, answered,
               nice: int = 0) -> None:
    """In a separate process (so its threads never hold the measuring process's GIL): ``clients`` threads post the
    pre-built image chat ``bodies`` (distinct images, so every one is a cache miss) back to back while the
    ``running`` event is set, until ``stop`` is set. ``inflight`` / ``answered`` (shared integers): requests sent and
    not yet answered / answered so far. ``nice``: the process's nice level."""
    if nice:
        os.nice(nice)
    next_body = iter(range(len(bodies)))
    lock = threading.Lock()

    def client(_i: int) -> None:
        post_body, close = keep_alive_poster(base_url, key, 120)
        try:
            while not stop.is_set():
                if not running.is_set():
                    close()  # an idle keep-alive connection would be closed by the server; reopened on resume
                    running.wait(0.05)
                    continue
                with lock:
                    k = next(next_body, None)
                if k is None:
                    return
                with inflight.get_lock():
                    inflight.value += 1
                try:
                    post_body("/v1/chat/completions", bodies[k])
                finally:
                    with inflight.get_lock():
                        inflight.value -= 1
                with answered.get_lock():
                    answered.value += 1
        finally:
            close()

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))


def repeat_part(live) -> None:
    """2. first vs second identical image request, median of 3 images, for both processor settings."""
    for model, label in ((VL_MODEL, "demo processor, <= 64 image tokens"),
                         (BIG_MODEL, "Qwen2-VL serving cap, <= 1280 image tokens")):
        post(live.base_url, live.api_key, "/v1/chat/completions", chat_bytes(model, data_url(image_bytes(seed=998))))
        pairs = []
        for seed in (1, 2, 3):  # each 4.3 MB body is serialized before the clock starts
            body = chat_bytes(model, data_url(image_bytes(size=(1200, 900), seed=seed)))
            t0 = time.perf_counter()
            post(live.base_url, live.api_key, "/v1/chat/completions", body)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            usage = post(live.base_url, live.api_key, "/v1/chat/completions", body)["usage"]
            pairs.append((first, time.perf_counter() - t0))
        first, second = sorted(p[0] for p in pairs)[1], sorted(p[1] for p in pairs)[1]
        print(f"image request ({label}; prompt {usage['prompt_tokens']} tokens, repeat reuses "
              f"{usage.get('prompt_tokens_details', {}).get('cached_tokens', 0)}): first {first*1000:.0f} ms, "
              f"second identical {second*1000:.0f} ms: {first/second:.1f}x faster (goal >= 10)", flush=True)


def warm_up(live) -> None:
    """Concurrent image chats and tokenize calls before any clock runs, so every render worker child has loaded
    the tokenizer and compiled the chat template (a cold child spends 1-3 s on that, measured under load)."""
    bodies = [chat_bytes(VL_MODEL, data_url(image_bytes(size=(400, 300), seed=5_000 + k))) for k in range(16)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda b: post(live.base_url, live.api_key, "/v1/chat/completions", b), bodies))
        list(pool.map(lambda _i: post(live.base_url, live.api_key, "/tokenize",
                                      {"model": VL_MODEL, "prompt": "warm"}), range(16)))


def chat_bytes(model: str, url: str) -> bytes:
    """Serialized body of a one-token image chat request (an image part, then a text part)."""
    return json.dumps({"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "describe"}]}]}).encode()


def pin_tree(pid: int, cpus: frozenset[int]) -> None:
    """Pin every thread of ``pid`` and of all its descendants to ``cpus`` (threads and processes created later
    inherit the mask from their creator)."""
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except (ProcessLookupError, FileNotFoundError):
                pass
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except FileNotFoundError:
                pass


def lay_out(live, args) -> tuple[frozenset[int] | None, frozenset[int] | None]:
    """Run the platform as ``manage.py serve`` does with ``--mm-api-workers`` / ``--frontend-cores``: a multimodal
    api on a unix socket and a front api pointed at it (``live.base_url`` moves to the new front), and the front
    api's CPUs. Returns ``(front, back)`` CPU sets for part 1's pinning, or ``(None, None)`` without it."""
    if args.mm_api_workers > 0:
        sock = str(live.var_dir / "mm-api.sock")
        live.sup.start("api-mm", [sys.executable, "-m", "ops.mm_api", "--uds", sock,
                                  "--workers", str(args.mm_api_workers)])
        wait_until(lambda: unix_socket_accepts(sock), 60, "multimodal api", live.sup)
        old = next(c for c in live.sup.children if c.name == "api")
        os.killpg(old.proc.pid, signal.SIGTERM)
        old.proc.wait(30)
        live.sup.children.remove(old)
        _child, live.base_url = live.start_api("api-front", env_extra={"MULTIMODAL_API_SOCKET": sock})
    if not args.frontend_cores:
        return None, None
    front = parse_cpu_list(args.frontend_cores)
    return front, frozenset(os.sched_getaffinity(0)) - front


def pin(live, front: frozenset[int], back: frozenset[int]) -> None:
    """The front api on ``front``, every other platform process on ``back`` (``front == back``: no pinning)."""
    for child in live.sup.children:
        pin_tree(child.proc.pid, front if child.name in ("api", "api-front") else back)


def tokenize_part(live, args, front, back) -> None:
    """1. text /tokenize latency alone vs while 8 clients send image chats (distinct 400x300 PNGs), in
    ``--rounds`` alternating windows of ``--seconds`` each (alone: image clients paused and drained; loaded: image
    clients running for a second already), so drift of the machine's speed during the run falls on both figures
    alike. Prints p50/p99 over all windows of each kind, the ratio per round and the median of those. With ``front`` CPUs the measuring
    client runs there and the image clients on ``back``."""
    warm_up(live)
    if front:
        pin(live, front, back)
        if os.environ.get("REDIS_URL"):
            print("note: REDIS_URL is set; that Redis server is not pinned (unset REDIS_URL for an embedded one)")
    bodies = [chat_bytes(VL_MODEL, data_url(image_bytes(size=(400, 300), seed=10_000 + k)))
              for k in range(args.images)]
    ctx = multiprocessing.get_context("spawn")
    running, stop = ctx.Event(), ctx.Event()
    inflight, answered = ctx.Value("i", 0), ctx.Value("i", 0)
    loader = ctx.Process(target=image_load, args=(live.base_url, live.api_key, bodies, 8, running, stop, inflight,
                                                  answered, args.client_nice))
    if back:
        os.sched_setaffinity(0, back)  # the image clients' process inherits this thread's mask
    loader.start()
    if front:
        os.sched_setaffinity(0, front)
    alone, loaded, rounds, n_images = [], [], [], 0
    try:
        for _ in range(args.rounds):
            running.clear()
            wait_until(lambda: inflight.value == 0, 120, "image requests to drain")
            a = tokenize_load(live, args.seconds)
            before = answered.value
            running.set()
            time.sleep(1)
            b = tokenize_load(live, args.seconds)
            n_images += answered.value - before
            alone += a
            loaded += b
            rounds.append((pct(b, .5) / pct(a, .5), pct(b, .99) / pct(a, .99)))
    finally:
        stop.set()
        running.set()
        loader.join(300)
    if answered.value >= args.images:
        print(f"warning: the image clients ran out of distinct images ({args.images}); raise --images")
    a50, a99, l50, l99 = pct(alone, .5), pct(alone, .99), pct(loaded, .5), pct(loaded, .99)
    if front:  # parts 2 and 3 run unpinned, as `manage.py serve` runs by default
        os.sched_setaffinity(0, front | back)
        pin(live, front | back, front | back)
    layout = (f"front api on cores {sorted(front)}, the rest on {sorted(back)}" if front else "no pinning")
    print(f"layout: {args.mm_api_workers} multimodal api process(es); {layout}")
    per_round = ", ".join(f"{r50:.2f}/{r99:.2f}" for r50, r99 in rounds)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    print(f"tokenize alone p50 {a50*1000:.1f} ms p99 {a99*1000:.1f} ms (n={len(alone)}); under image load "
          f"p50 {l50*1000:.1f} ms p99 {l99*1000:.1f} ms (n={len(loaded)}, {n_images} image requests in "
          f"{args.rounds} x {args.seconds:g} s); ratio p50 {l50/a50:.2f}x p99 {l99/a99:.2f}x (goal <= 1.2); "
          f"per round p50/p99: {per_round} (median {med([r[0] for r in rounds]):.2f}/{med([r[1] for r in rounds]):.2f})",
          flush=True)


def embeddings_part(live, args) -> None:
    """3. embeddings throughput at batch 32: direct, then the api with 2 concurrent clients and with one client,
    in ``--emb-rounds`` alternating rounds; prints the median per-round ratio and its range."""
    texts = [f"sentence {i} about a cat sitting on a mat in the sun" for i in range(32)]
    # base64 is what the official openai client asks for by default (it decodes the vectors with numpy)
    emb_body = json.dumps({"model": "minilm", "input": texts, "encoding_format": "base64"}).encode()

    def embed_api() -> list:
        data = post(live.base_url, live.api_key, "/v1/embeddings", emb_body)["data"]
        return [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data]

    direct = DirectMiniLM(minilm_dir())
    direct.embed(texts)
    assert float(np.abs(np.stack(embed_api()) - direct.embed(texts).numpy()).max()) < 1e-5

    def direct_rate() -> float:
        t0 = time.perf_counter()
        for _ in range(args.emb_reps):
            direct.embed(texts)
        return args.emb_reps * 32 / (time.perf_counter() - t0)

    def api_rate(clients: int) -> float:
        def one(_i):
            for _ in range(args.emb_reps // clients):
                embed_api()
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            list(pool.map(one, range(clients)))
        return (args.emb_reps // clients) * clients * 32 / (time.perf_counter() - t0)

    # alternating short rounds, a ratio per round against the direct figure measured just before it, and the
    # median of those: the direct rate alone drifts 170-260 inputs/s between runs on this shared 2-core box
    rounds = []
    for _ in range(args.emb_rounds):
        d = direct_rate()
        rounds.append((d, api_rate(2) / d, api_rate(1) / d))
    med = lambda xs: sorted(xs)[len(xs) // 2]
    r2, r1 = [r[1] for r in rounds], [r[2] for r in rounds]
    print(f"embeddings batch 32 ({args.emb_rounds} rounds of {args.emb_reps} batches): direct "
          f"{med([r[0] for r in rounds]):.0f} inputs/s (median); api / direct, median of the rounds: 2 concurrent "
          f"clients {med(r2):.2f} (range {min(r2):.2f}-{max(r2):.2f}; goal >= 0.8), one client at a time "
          f"{med(r1):.2f} (range {min(r1):.2f}-{max(r1):.2f})", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5, help="length of each part-1 window")
    ap.add_argument("--rounds", type=int, default=5, help="alternating alone/loaded windows in part 1")
    ap.add_argument("--images", type=int, default=600, help="distinct images for the image clients")
    ap.add_argument("--parts", default="1,2,3", help="which measurements to run (comma-separated)")
    ap.add_argument("--engine-threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads of the VL engines (default: every core, as `manage.py serve` runs them; with "
                         "one core left to the frontend the engine only serves the closed-loop image clients faster, "
                         "which then load the api and render processes more)")
    ap.add_argument("--engine-nice", type=int, default=0, help="nice level of the VL engine processes")
    ap.add_argument("--client-nice", type=int, default=0, help="nice level of the image load clients' process")
    ap.add_argument("--frontend-cores", default="0" if len(os.sched_getaffinity(0)) >= 2 else "",
                    help="CPUs of the front api and the measuring client (manage.py serve --frontend-cores); '' "
                         "for no pinning")
    ap.add_argument("--mm-api-workers", type=int, default=1,
                    help="multimodal api processes the front api hands image chats to (0: the front serves them)")
    ap.add_argument("--emb-reps", type=int, default=40, help="batches of 32 per embeddings measurement")
    ap.add_argument("--emb-rounds", type=int, default=5, help="alternating direct/api rounds (median reported)")
    args = ap.parse_args()
    # one tenant's 8 image clients: above the per-tenant image concurrency cap of a real deployment (2)
    os.environ.setdefault("MM_TENANT_MAX_CONCURRENT", "16")
    ensure_vl_model()
    live = start_platform(Path(tempfile.mkdtemp()), engine=False, max_model_len=1024)
    try:
        live.manage("register_model", VL_MODEL, str(VL_DIR), "--max-model-len", "1024")
        live.manage("register_model", "minilm", minilm_dir(), "--task", "embed", "--max-model-len", "256")
        # the platform's own mm worker (one, niced, like `manage.py serve`) preprocesses the images
        nice = ["nice", "-n", str(args.engine_nice)] if args.engine_nice else []
        parts = {int(x) for x in args.parts.split(",")}
        threads = ["--num-threads", str(args.engine_threads)]
        print(f"VL engines: {args.engine_threads} torch thread(s) of {os.cpu_count()} cores, nice {args.engine_nice}")
        live.sup.start("vl-engine", nice + [sys.executable, "-m", "inference.engine", "--model", VL_MODEL, "--model-dir",
                                            str(VL_DIR), "--redis-url", live.redis_url, "--link-prefix", live.prefix]
                       + threads)
        big_dir = capped_model_dir(1280)
        live.manage("register_model", BIG_MODEL, str(big_dir), "--max-model-len", "2048")
        live.sup.start("vl-engine-1280", nice + [sys.executable, "-m", "inference.engine", "--model", BIG_MODEL,
                                          "--model-dir", str(big_dir), "--redis-url", live.redis_url,
                                          "--link-prefix", live.prefix, "--max-model-len", "2048"] + threads)
        live.sup.start("embed-engine", [sys.executable, "-m", "inference.engine", "--model", "minilm", "--model-dir",
                                        minilm_dir(), "--task", "embed", "--redis-url", live.redis_url,
                                        "--link-prefix", live.prefix])
        wait_until(lambda: live.replicas(VL_MODEL) and live.replicas(BIG_MODEL) and live.replicas("minilm"), 180,
                   "engines", live.sup)

        front, back = lay_out(live, args)
        post(live.base_url, live.api_key, "/v1/chat/completions", chat_bytes(VL_MODEL, data_url(image_bytes(seed=999))))
        if 2 in parts:
            repeat_part(live)
        if 1 in parts:
            tokenize_part(live, args, front, back)
        if 3 in parts:
            embeddings_part(live, args)
    finally:
        live.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
