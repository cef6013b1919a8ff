"""Per-process cache of served-model snapshots (registry rows as plain dicts), at most 1 s old.

The ORM read runs off the event loop; a model disabled or edited in the admin is seen by every api process
within a second.
"""

from __future__ import annotations

import time

from asgiref.sync import sync_to_async

from registry.selectors import served_model_snapshot

MODEL_CACHE_TTL_S = 1.0
_cache: dict[str, tuple[float, dict | None]] = {}


async def get_model(name: str) -> dict | None:
    """Snapshot of the enabled served model ``name`` or ``None`` (unknown or disabled)."""
    now = time.monotonic()
    hit = _cache.get(name)
    if hit is not None and hit[0] > now:
        return hit[1]
    snap = await sync_to_async(served_model_snapshot, thread_sensitive=False)(name)
    if snap is not None and not snap.get("enabled", True):
        snap = None
    if len(_cache) > 1000:
        _cache.clear()
    _cache[name] = (now + MODEL_CACHE_TTL_S, snap)
    return snap
