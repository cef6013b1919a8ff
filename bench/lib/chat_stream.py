"""Concurrent streaming chats through an OpenAI-compatible server (the platform, or vLLM's own): prompts that no
other round shares, a lean SSE reader that times the first content chunk, and the mean over rounds."""

from __future__ import annotations

import asyncio
import json
import time

from bench.lib.stats import pct
from harness.assets import DEMO_MODEL


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
