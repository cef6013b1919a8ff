"""Issue 2 benchmark: 16 concurrent streaming chats through the whole platform vs ``transformers`` ``generate``.

Both sides run the same 16 prompts (the Qwen3 chat template, real tokenizer) on the same demo model in this
one run, each generating exactly ``--max-tokens`` tokens (EOS ignored, so the work is identical):

* platform: a live platform (Redis or ``REDIS_URL``, Celery worker, engine, uvicorn) started here; 16 clients
  stream at once over HTTP (a lean httpx SSE reader); TTFT = time to the first content chunk.
* direct: one left-padded batch through ``model.generate`` in this process; TTFT = time until the first
  token is chosen (a logits processor records the first call).

Both sides get the same treatment: one warm-up, then ``--rounds`` measured rounds, each round with prompts no
other round or warm-up used (so the platform's prefix cache never serves a measured prompt; the direct side has
no such cache), and the same statistic (the mean over rounds of each figure). Prints TTFT p50/p99, output
tokens/s and the platform/direct ratios. Usage:
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

from harness.assets import DEMO_MODEL, MODEL_DIR
from harness.live_platform import start_platform


def prompts(n: int, phase: str) -> list[list[dict]]:
    """``n`` conversations of ``phase`` (``warm-up``, ``round 1``, ...): the phase and the index lead the
    prompt, so no two phases share a prefix the engine's prefix cache could serve."""
    topics = ["the sea", "mountains", "a robot", "coffee", "the moon", "a library", "rain", "trains",
              "a garden", "winter", "music", "a city at night", "bees", "a lighthouse", "deserts", "clocks"]
    return [[{"role": "user", "content": f"[{phase}, story {i}] Write a short story about "
                                         f"{topics[i % len(topics)]}."}] for i in range(n)]


def mean_of(runs: list[dict]) -> dict:
    """The mean of each figure over rounds (the one statistic both sides are reported with)."""
    return {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, int(round(q * (len(values) - 1)))))
    return values[k]


async def run_platform(base_url: str, api_key: str, convs, max_tokens: int, model: str = DEMO_MODEL) -> dict:
    """Stream every conversation at once through the HTTP API (``model``); TTFT = first content chunk.

    The client is a lean ``httpx`` SSE reader (the bench process shares the 2 cores with the platform, so a
    heavy client would measure itself); the official ``openai`` client is exercised by the test suite.
    """
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"}
    limits = httpx.Limits(max_connections=len(convs) + 4, max_keepalive_connections=len(convs) + 4)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=300, limits=limits) as http:
        async def one(messages):
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
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


def run_direct(rounds: list, warm, max_tokens: int) -> list[dict]:
    """One warm-up batch (``warm``), then one measured batch per element of ``rounds`` (lists of
    conversations); returns one result per round."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    model.eval()

    def batch_of(convs):
        texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
        return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    with torch.inference_mode():  # warm-up
        model.generate(**batch_of(warm), max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
    return [_direct_round(model, tok, batch_of(convs), max_tokens) for convs in rounds]


def _direct_round(model, tok, batch, max_tokens: int) -> dict:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstCall(LogitsProcessor):
        def __init__(self):
            self.t = None

        def __call__(self, input_ids, scores):
            if self.t is None:
                self.t = time.perf_counter()
            return scores

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
    ap.add_argument("--rounds", type=int, default=2,
                    help="measured rounds per side, after one warm-up; each round's prompts are new")
    args = ap.parse_args()
    warm = prompts(args.concurrency, "warm-up")
    rounds = [prompts(args.concurrency, f"round {r + 1}") for r in range(args.rounds)]

    live = start_platform(Path(tempfile.mkdtemp(prefix="bench-")))
    try:
        asyncio.run(run_platform(live.base_url, live.api_key, warm, 4))  # warm tokenizer/template caches
        plat_runs = [asyncio.run(run_platform(live.base_url, live.api_key, convs, args.max_tokens))
                     for convs in rounds]
    finally:
        live.stop()
    direct_runs = run_direct(rounds, warm, args.max_tokens)
    plat, direct = mean_of(plat_runs), mean_of(direct_runs)

    print(f"\n{args.concurrency} concurrent streaming chats, {args.max_tokens} new tokens each, demo model, CPU; "
          f"mean of {args.rounds} round(s) per side, fresh prompts each round")
    print(f"{'':10} {'TTFT p50 s':>11} {'TTFT p99 s':>11} {'tokens/s':>10} {'wall s':>8}")
    for name, r in (("platform", plat), ("direct", direct)):
        print(f"{name:10} {r['ttft_p50']:11.3f} {r['ttft_p99']:11.3f} {r['tok_s']:10.1f} {r['wall_s']:8.2f}")
    print(f"ratio platform/direct: tokens/s {plat['tok_s'] / direct['tok_s']:.2f}x, "
          f"TTFT p50 {plat['ttft_p50'] / direct['ttft_p50']:.2f}x")


if __name__ == "__main__":
    main()
