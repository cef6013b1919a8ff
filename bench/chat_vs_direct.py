"""Issue 2 benchmark: 16 concurrent streaming chats through the whole platform vs ``transformers`` ``generate``.

Both sides run the same 16 prompts (the Qwen3 chat template, real tokenizer) on the same demo model in this
one run, each generating exactly ``--max-tokens`` tokens (EOS ignored, so the work is identical):

* platform: a live platform (Redis or ``REDIS_URL``, Celery worker, engine, uvicorn) started here; 16 clients
  stream at once over HTTP (a lean httpx SSE reader); TTFT = time to the first content chunk.
* direct: one left-padded batch through ``model.generate`` in this process; TTFT = time until the first
  token is chosen (a logits processor records the first call).

Prints TTFT p50/p99, output tokens/s and the platform/direct ratios. Usage:
``.venv/bin/python bench/chat_vs_direct.py [--concurrency 16] [--max-tokens 64] [--rounds 2]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from tests.live_platform import DEMO_MODEL, MODEL_DIR, start_platform


def prompts(n: int) -> list[list[dict]]:
    topics = ["the sea", "mountains", "a robot", "coffee", "the moon", "a library", "rain", "trains",
              "a garden", "winter", "music", "a city at night", "bees", "a lighthouse", "deserts", "clocks"]
    return [[{"role": "user", "content": f"Write a short story about {topics[i % len(topics)]}."}]
            for i in range(n)]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, int(round(q * (len(values) - 1)))))
    return values[k]


async def run_platform(base_url: str, api_key: str, convs, max_tokens: int) -> dict:
    """Stream every conversation at once through the HTTP API; TTFT = first content chunk.

    The client is a lean ``httpx`` SSE reader (the bench process shares the 2 cores with the platform, so a
    heavy client would measure itself); the official ``openai`` client is exercised by the test suite.
    """
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"}
    limits = httpx.Limits(max_connections=len(convs) + 4, max_keepalive_connections=len(convs) + 4)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=300, limits=limits) as http:
        async def one(messages):
            body = {"model": DEMO_MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
            t0 = time.perf_counter()
            ttft = None
            n = 0
            async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if ttft is None and '"content":"' in line and '"content":""' not in line:
                        ttft = time.perf_counter() - t0
                    if '"usage":{' in line and '"choices":[]' in line:
                        n = json.loads(line[6:])["usage"]["completion_tokens"]
            return ttft, n

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(m) for m in convs))
        wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results if r[0] is not None]
    tokens = sum(r[1] for r in results)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "ttft_p50": pct(ttfts, 0.5),
            "ttft_p99": pct(ttfts, 0.99)}


def run_direct(convs, max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    model.eval()
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    class FirstCall(LogitsProcessor):
        def __init__(self):
            self.t = None

        def __call__(self, input_ids, scores):
            if self.t is None:
                self.t = time.perf_counter()
            return scores

    with torch.inference_mode():  # warm-up
        model.generate(**batch, max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
    first = FirstCall()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id, logits_processor=LogitsProcessorList([first]))
    wall = time.perf_counter() - t0
    tokens = (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    ttft = first.t - t0
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "ttft_p50": ttft, "ttft_p99": ttft}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="platform rounds (best kept; first warms caches)")
    args = ap.parse_args()
    convs = prompts(args.concurrency)

    live = start_platform(Path(tempfile.mkdtemp(prefix="bench-")))
    try:
        asyncio.run(run_platform(live.base_url, live.api_key, convs[:2], 4))  # warm tokenizer/template caches
        runs = [asyncio.run(run_platform(live.base_url, live.api_key, convs, args.max_tokens))
                for _ in range(args.rounds)]
        plat = max(runs, key=lambda r: r["tok_s"])
    finally:
        live.stop()
    direct = run_direct(convs, args.max_tokens)

    print(f"\n{args.concurrency} concurrent streaming chats, {args.max_tokens} new tokens each, demo model, CPU")
    print(f"{'':10} {'TTFT p50 s':>11} {'TTFT p99 s':>11} {'tokens/s':>10} {'wall s':>8}")
    for name, r in (("platform", plat), ("direct", direct)):
        print(f"{name:10} {r['ttft_p50']:11.3f} {r['ttft_p99']:11.3f} {r['tok_s']:10.1f} {r['wall_s']:8.2f}")
    print(f"ratio platform/direct: tokens/s {plat['tok_s'] / direct['tok_s']:.2f}x, "
          f"TTFT p50 {plat['ttft_p50'] / direct['ttft_p50']:.2f}x")


if __name__ == "__main__":
    main()
