"""A separate OS process that takes one key-limit concurrency slot with the default lease and keepalive and holds it
until it is killed (used by the lease-expiry test: a ``kill -9`` of an api process, in small).

Usage: ``python lease_holder.py REDIS_URL PREFIX KEY_ID``; prints ``held`` once the slot is taken.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "platform"), str(Path(__file__).resolve().parents[2])]

import redis.asyncio as redis_async  # noqa: E402

from tenancy.limits import Limits, limits_acquire  # noqa: E402

from tests.support.limits_context import Ctx  # noqa: E402


async def main() -> None:
    url, prefix, key_id = sys.argv[1:4]
    client = redis_async.Redis.from_url(url)
    await limits_acquire(client, prefix, Ctx(int(key_id), int(key_id), Limits(max_concurrent=1)),
                         max_tokens_reserved=1)
    print("held", flush=True)
    await asyncio.sleep(3600)  # the keepalive task renews the lease until this process is killed


if __name__ == "__main__":
    asyncio.run(main())
