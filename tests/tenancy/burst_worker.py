"""A separate OS process hammering ``limits_acquire`` (used by the cross-process burst test).

Usage: ``python burst_worker.py REDIS_URL PREFIX ATTEMPTS RESERVE KEY_ID TENANT_ID RPM TPM CONC BUDGET``
(limits of the key; 0 = unlimited). Waits until the shared start time in ``PREFIX:go``, then fires
``ATTEMPTS`` acquires concurrently without settling them, and prints ``<granted> <refused>``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "platform"), str(Path(__file__).resolve().parents[2])]

import redis.asyncio as redis_async  # noqa: E402

from tenancy.limits import Limits, RateLimitExceeded, limits_acquire  # noqa: E402

from tests.support.limits_context import Ctx  # noqa: E402


async def main() -> None:
    url, prefix, attempts, reserve, key_id, tenant_id, rpm, tpm, conc, budget = sys.argv[1:11]
    ctx = Ctx(int(key_id), int(tenant_id), Limits(rpm=int(rpm), tpm=int(tpm), max_concurrent=int(conc),
                                                  token_budget=int(budget), budget_period="day"))
    client = redis_async.Redis.from_url(url)
    go = None
    for _ in range(500):
        go = await client.get(f"{prefix}:go")
        if go:
            break
        await asyncio.sleep(0.01)
    delay = float(go) - time.time() if go else 0
    if delay > 0:
        await asyncio.sleep(delay)

    async def one():
        try:
            await limits_acquire(client, prefix, ctx, max_tokens_reserved=int(reserve), keepalive=False)
            return True
        except RateLimitExceeded:
            return False

    results = await asyncio.gather(*(one() for _ in range(int(attempts))))
    print(sum(results), len(results) - sum(results))
    await client.aclose()


asyncio.run(main())
