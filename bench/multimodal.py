"""Multimodal + embeddings benchmark (issue 6). Starts a live platform (tests/live_platform.py) with the
demo Qwen2-VL model, an ``mm`` worker and an all-MiniLM-L6-v2 pooling engine, then prints:

1. p50/p99 latency of text ``/tokenize`` requests alone, and while 8 clients send image chat requests
   continuously (goal: ratio ≤ 1.2);
2. time of the second identical image request vs the first (goal: ≥ 10× faster);
3. embeddings throughput (inputs/s at batch 32) via /v1/embeddings vs the model run directly (goal ≥ 0.8×).

Usage: ``REDIS_URL=redis://127.0.0.1:6379/13 python bench/multimodal.py [--seconds 10]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
import threading
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
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST", headers={
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8)
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

        def chat(url):
            return post(live.base_url, live.api_key, "/v1/chat/completions", {"model": VL_MODEL, "max_tokens": 1,
                        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                                  {"type": "text", "text": "describe"}]}]})

        chat(data_url(image_bytes(seed=999)))  # warm the mm worker's processor
        # 2. first vs second identical image
        url = data_url(image_bytes(size=(1200, 900), seed=1))
        t0 = time.perf_counter(); chat(url); first = time.perf_counter() - t0
        t0 = time.perf_counter(); chat(url); second = time.perf_counter() - t0
        # 1. tokenize latency alone vs under image load
        alone = tokenize_load(live, args.seconds)
        stop = threading.Event()
        counter = {"n": 0}

        def image_client(i):
            k = 0
            while not stop.is_set():
                chat(data_url(image_bytes(size=(400, 300), seed=10_000 + i * 100_000 + k)))
                counter["n"] += 1
                k += 1

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(image_client, i) for i in range(8)]
            time.sleep(1)
            loaded = tokenize_load(live, args.seconds)
            stop.set()
            for f in futs:
                f.result()
        # 3. embeddings throughput at batch 32
        texts = [f"sentence {i} about a cat sitting on a mat in the sun" for i in range(32)]
        direct = DirectMiniLM(minilm_dir())
        direct.embed(texts)
        t0 = time.perf_counter(); reps = 10
        for _ in range(reps):
            direct.embed(texts)
        direct_rate = reps * 32 / (time.perf_counter() - t0)
        post(live.base_url, live.api_key, "/v1/embeddings", {"model": "minilm", "input": texts})
        t0 = time.perf_counter()
        for _ in range(reps):
            post(live.base_url, live.api_key, "/v1/embeddings", {"model": "minilm", "input": texts})
        api_rate = reps * 32 / (time.perf_counter() - t0)
        a50, a99, l50, l99 = pct(alone, .5), pct(alone, .99), pct(loaded, .5), pct(loaded, .99)
        print(f"tokenize alone p50 {a50*1000:.1f} ms p99 {a99*1000:.1f} ms (n={len(alone)}); under image load "
              f"p50 {l50*1000:.1f} ms p99 {l99*1000:.1f} ms (n={len(loaded)}, {counter['n']} image requests); "
              f"ratio p50 {l50/a50:.2f}x p99 {l99/a99:.2f}x (goal <= 1.2)")
        print(f"image request first {first*1000:.0f} ms, second identical {second*1000:.0f} ms: "
              f"{first/second:.1f}x faster (goal >= 10)")
        print(f"embeddings batch 32: api {api_rate:.0f} inputs/s, direct {direct_rate:.0f} inputs/s, "
              f"ratio {api_rate/direct_rate:.2f} (goal >= 0.8)")
    finally:
        live.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
