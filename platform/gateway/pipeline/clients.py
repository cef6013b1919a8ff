"""The api process's shared clients, one per process and event loop: its Redis pool, its engine link and its
admission client. Every gateway module gets them here (nothing else builds a Redis client)."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from django.conf import settings

from inference.admission import Admission
from inference.engine_client import EngineLink

_pools: dict[int, tuple[asyncio.AbstractEventLoop, aioredis.Redis]] = {}


def redis() -> aioredis.Redis:
    """This process's Redis pool for the running event loop (``settings.REDIS_URL``; created on first use): key
    limits, usage events, image slots, the feature cache, the generate abort map."""
    loop = asyncio.get_running_loop()
    entry = _pools.get(id(loop))
    if entry is None or entry[0] is not loop:
        entry = (loop, aioredis.Redis.from_url(settings.REDIS_URL, max_connections=256))
        _pools[id(loop)] = entry
    return entry[1]


def link() -> EngineLink:
    """This process's engine link (DESIGN.md §2 steps 8-10)."""
    return EngineLink.for_current_process(settings.REDIS_URL, settings.LINK_PREFIX)


def admission() -> Admission:
    """This process's shared-admission client (DESIGN.md §3)."""
    return Admission.for_current_process(settings.REDIS_URL, settings.LINK_PREFIX)
