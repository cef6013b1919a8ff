"""Load of ``max_tokens=1`` completions of token-id prompts, each a prefill and one token (its latency is its TTFT):
a closed loop that measures capacity, and an open loop at a set rate whose accepted, refused (503) and other
answers are counted. Every prompt of a run is new, so the engine's prefix cache never skips a prefill."""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import aiohttp

from bench.lib.stats import pct
from harness.assets import DEMO_MODEL



async def one_aio(session: aiohttp.ClientSession, url: str, headers: dict, body: bytes) -> tuple[int, float]:
    """POST ``body`` to ``url``; ``(HTTP status, seconds to the whole answer)``, status 0 when the connection failed."""
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=headers) as r:
            await r.read()
            return r.status, time.perf_counter() - t0
    except aiohttp.ClientError:  # connection reset/refused under overload: counted in "other" (status 0)
        return 0, time.perf_counter() - t0


_next_prompt = itertools.count()  # one sequence for the whole run: no phase (warm-up, capacity, loads) repeats a body


def prompt_for(i: int, length: int) -> list[int]:
    """Prompt ``i`` of the run: ``length`` token ids whose first two differ per request, so the engine's prefix cache
    cannot skip the prefill."""
    return [1000 + (i % 50000), 1000 + (i // 50000) % 50000] + [200 + (j * 7 + i) % 5000 for j in range(length - 2)]


async def calibrate(base, key, length, concurrency, seconds) -> float:
    """Capacity of the platform at ``base`` (key ``key``) in prompt tokens per second end to end: ``concurrency``
    clients in a closed loop of ``length``-token, ``max_tokens=1`` completions for ``seconds``, after a warm-up of the
    same length."""
    done = 0
    stop_at = time.perf_counter() + seconds
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    url = f"{base}/v1/completions"
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as client:
        async def worker(w):
            nonlocal done
            while time.perf_counter() < stop_at:
                body = json.dumps({"model": DEMO_MODEL, "prompt": prompt_for(next(_next_prompt), length),
                                   "max_tokens": 1}).encode()
                status, _ = await one_aio(client, url, headers, body)
                if status == 200:
                    done += 1
        await asyncio.gather(*(worker(w) for w in range(concurrency)))  # warm-up (its bodies are never resent)
        done = 0
        stop_at = time.perf_counter() + seconds
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return done * length / elapsed


async def offer(base, key, length, rate_rps, duration_s) -> dict:
    """Open-loop load: requests at uniform arrival times; each body is serialized before its send time, and
    the client is aiohttp (C HTTP parser), so the latencies are the server's, not the load generator's."""
    total = int(rate_rps * duration_s)
    bodies = [json.dumps({"model": DEMO_MODEL, "prompt": prompt_for(next(_next_prompt), length),
                          "max_tokens": 1}).encode() for _ in range(total)]
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    url = f"{base}/v1/completions"
    connector = aiohttp.TCPConnector(limit=2000)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        tasks = []
        t0 = time.perf_counter()
        for i in range(total):
            delay = t0 + i / rate_rps - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_aio(session, url, headers, bodies[i])))
        results = await asyncio.gather(*tasks)
    ok = [lat for status, lat in results if status == 200]
    refused = [lat for status, lat in results if status == 503]
    other = [status for status, _ in results if status not in (200, 503)]
    return {"offered": len(results), "accepted": len(ok), "refused": len(refused), "other": len(other),
            "worst": max(ok, default=float("nan")), "p50": pct(ok, 0.5), "p99": pct(ok, 0.99), "p99_503_ms": pct(refused, 0.99) * 1000}
