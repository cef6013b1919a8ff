"""Multimodal + embeddings benchmark (issue 6). Starts a live platform (tests/live_platform.py) with the
demo Qwen2-VL model, an ``mm`` worker and an all-MiniLM-L6-v2 pooling engine, then prints:

1. p50/p99 latency of text ``/tokenize`` requests alone, and while 8 clients send image chat requests
   continuously (goal: ratio ≤ 1.2). The image clients run in their own process and post request bodies
   built before the run (distinct random 400x300 PNGs: every one is a cache miss), so the measuring
   client's timings include no image encoding and no GIL wait behind them;
2. time of the second identical image request vs the first (goal: ≥ 10× faster);
3. embeddings throughput (inputs/s at batch 32) via /v1/embeddings vs the model run directly (goal ≥ 0.8×):
   with 2 concurrent clients (a throughput figure: the engine never waits for the next request's HTTP,
   JSON and tokenizing) and with one client at a time (every request's full latency in the figure).

Usage: ``REDIS_URL=redis://127.0.0.1:6379/13 python bench/multimodal.py [--seconds 10]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from tests.embeddings.reference import DirectMiniLM, minilm_dir  # noqa: E402
from tests.live_platform import start_platform, wait_until  # noqa: E402
from tests.multimodal.conftest import VL_DIR, VL_MODEL, ensure_vl_model  # noqa: E402
from tests.multimodal.imgs import data_url, image_bytes  # noqa: E402


def post(base, key, path, body, timeout=120):
    """POST ``body`` (a dict, or bytes already serialized) and return the decoded JSON answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def tokenize_load(live, seconds):
    lat = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        post(live.base_url, live.api_key, "/tokenize", {"model": VL_MODEL, "prompt": "hello world " * 20})
        lat.append(time.perf_counter() - t0)
    return lat


def image_load(base_url: str, key: str, bodies: list[bytes], clients: int, seconds: float, started, done) -> None:
    """In a separate process (so its threads never hold the measuring process's GIL): ``clients`` threads
    post the pre-built image chat ``bodies`` (distinct images, so every one is a cache miss) back to back
    for ``seconds``; puts the number of answered requests on ``done``."""
    count = [0] * clients

    def client(i: int) -> None:
        end = time.monotonic() + seconds
        k = i
        while time.monotonic() < end and k < len(bodies):
            req = urllib.request.Request(base_url + "/v1/chat/completions", data=bodies[k], method="POST",
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                resp.read()
            count[i] += 1
            k += clients

    started.set()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    done.put(sum(count))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--images", type=int, default=600, help="distinct images for the image clients")
    ap.add_argument("--emb-reps", type=int, default=20, help="batches of 32 per embeddings measurement")
    args = ap.parse_args()
    ensure_vl_model()
    live = start_platform(Path(tempfile.mkdtemp()), engine=False, max_model_len=1024)
    try:
        live.manage("register_model", VL_MODEL, str(VL_DIR), "--max-model-len", "1024")
        live.manage("register_model", "minilm", minilm_dir(), "--task", "embed", "--max-model-len", "256")
        # the platform's own mm worker (one, niced, like `manage.py serve`) preprocesses the images
        live.sup.start("vl-engine", [sys.executable, "-m", "inference.engine", "--model", VL_MODEL, "--model-dir",
                                     str(VL_DIR), "--redis-url", live.redis_url, "--link-prefix", live.prefix])
        live.sup.start("embed-engine", [sys.executable, "-m", "inference.engine", "--model", "minilm", "--model-dir",
                                        minilm_dir(), "--task", "embed", "--redis-url", live.redis_url,
                                        "--link-prefix", live.prefix])
        wait_until(lambda: live.replicas(VL_MODEL) and live.replicas("minilm"), 180, "engines", live.sup)

        def chat_body(url) -> bytes:
            return json.dumps({"model": VL_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "describe"}]}]}).encode()

        post(live.base_url, live.api_key, "/v1/chat/completions", chat_body(data_url(image_bytes(seed=999))))  # warm
        # 2. first vs second identical image (the 4.3 MB body is serialized before the clock starts)
        body = chat_body(data_url(image_bytes(size=(1200, 900), seed=1)))
        t0 = time.perf_counter(); post(live.base_url, live.api_key, "/v1/chat/completions", body)
        first = time.perf_counter() - t0
        t0 = time.perf_counter(); post(live.base_url, live.api_key, "/v1/chat/completions", body)
        second = time.perf_counter() - t0
        # 1. tokenize latency alone vs under image load (8 clients, distinct 400x300 PNGs built beforehand)
        alone = tokenize_load(live, args.seconds)
        bodies = [json.dumps({"model": VL_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(image_bytes(size=(400, 300), seed=10_000 + k))}},
            {"type": "text", "text": "describe"}]}]}).encode() for k in range(args.images)]
        ctx = multiprocessing.get_context("spawn")
        started, done = ctx.Event(), ctx.Queue()
        loader = ctx.Process(target=image_load, args=(live.base_url, live.api_key, bodies, 8, args.seconds + 2,
                                                      started, done))
        loader.start()
        started.wait(60)
        time.sleep(1)
        loaded = tokenize_load(live, args.seconds)
        n_images = done.get(timeout=300)
        loader.join(60)
        if n_images >= args.images:
            print(f"warning: the image clients ran out of distinct images ({args.images}); raise --images")
        # 3. embeddings throughput at batch 32: direct, api with one client, api with 2 concurrent clients
        texts = [f"sentence {i} about a cat sitting on a mat in the sun" for i in range(32)]
        emb_body = json.dumps({"model": "minilm", "input": texts}).encode()
        direct = DirectMiniLM(minilm_dir())
        direct.embed(texts)
        post(live.base_url, live.api_key, "/v1/embeddings", emb_body)

        def direct_rate() -> float:
            t0 = time.perf_counter()
            for _ in range(args.emb_reps):
                direct.embed(texts)
            return args.emb_reps * 32 / (time.perf_counter() - t0)

        def api_rate(clients: int) -> float:
            def one(_i):
                for _ in range(args.emb_reps // clients):
                    post(live.base_url, live.api_key, "/v1/embeddings", emb_body)
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                list(pool.map(one, range(clients)))
            return (args.emb_reps // clients) * clients * 32 / (time.perf_counter() - t0)

        # interleaved, twice each, so drift of the machine hits both sides alike
        rates = {"direct": [], "api1": [], "api2": []}
        for _ in range(2):
            rates["direct"].append(direct_rate())
            rates["api1"].append(api_rate(1))
            rates["api2"].append(api_rate(2))
        direct_r = sum(rates["direct"]) / 2
        api1_r, api2_r = sum(rates["api1"]) / 2, sum(rates["api2"]) / 2
        a50, a99, l50, l99 = pct(alone, .5), pct(alone, .99), pct(loaded, .5), pct(loaded, .99)
        print(f"tokenize alone p50 {a50*1000:.1f} ms p99 {a99*1000:.1f} ms (n={len(alone)}); under image load "
              f"p50 {l50*1000:.1f} ms p99 {l99*1000:.1f} ms (n={len(loaded)}, {n_images} image requests); "
              f"ratio p50 {l50/a50:.2f}x p99 {l99/a99:.2f}x (goal <= 1.2)")
        print(f"image request first {first*1000:.0f} ms, second identical {second*1000:.0f} ms: "
              f"{first/second:.1f}x faster (goal >= 10)")
        print(f"embeddings batch 32: direct {direct_r:.0f} inputs/s; api, 2 concurrent clients {api2_r:.0f} "
              f"inputs/s, ratio {api2_r/direct_r:.2f} (goal >= 0.8); api, one client at a time {api1_r:.0f} "
              f"inputs/s, ratio {api1_r/direct_r:.2f}")
    finally:
        live.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
