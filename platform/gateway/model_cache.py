"""Per-process cache of served-model snapshots (``ModelSnapshot``: frozen, typed), at most 1 s old.

The ORM read runs off the event loop, one at a time per name (concurrent misses share it:
``gateway.single_flight``); a model disabled or edited in the admin is seen by every api process within a second.
The cache is a bounded LRU (``MODEL_CACHE_MAX_ENTRIES``) holding known and unknown names alike, so a stream of
made-up names can neither grow it nor flush the served models out of it all at once; a name that cannot be a served
model name (``SERVED_MODEL_NAME_RE``) is answered ``None`` without a query and is not cached.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any

from channels.db import database_sync_to_async  # closes broken DB connections (a PostgreSQL restart)
from django.db import DatabaseError

from gateway.errors import database_unavailable
from gateway.single_flight import SingleFlight

from inference.protocol.openai import SERVED_MODEL_NAME_RE
from registry.selectors import served_model_snapshot

MODEL_CACHE_TTL_S = 1.0
MODEL_CACHE_MAX_ENTRIES = 1024
_NAME = re.compile(SERVED_MODEL_NAME_RE)


@dataclass(frozen=True, slots=True)
class ModelSnapshot:
    """What the request path needs from a served model's registry row (``registry.selectors.
    served_model_snapshot_from`` gives the field meanings). Frozen: a request sees one consistent version."""

    served_model_name: str
    model_dir: str
    tokenizer_dir: str
    max_model_len: int
    chat_template: str | None = None
    allow_request_chat_template: bool = False
    allow_control_tokens_in_content: bool = False
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"
    task: str = "generate"
    enabled: bool = True
    dtype: str = ""
    device: str = ""
    max_num_seqs: int | None = None
    unsupported_features: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, snap: dict[str, Any]) -> ModelSnapshot:
        """From the registry's snapshot dict (unknown keys, e.g. ``name``, are ignored)."""
        names = {f.name for f in fields(cls)}
        kept = {k: v for k, v in snap.items() if k in names}
        if "unsupported_features" in kept:
            kept["unsupported_features"] = tuple(kept["unsupported_features"])
        return cls(**kept)


_cache: OrderedDict[str, tuple[float, ModelSnapshot | None]] = OrderedDict()
_lookups: SingleFlight[ModelSnapshot | None] = SingleFlight()  # concurrent misses of one name share one read


async def get_model(name: str) -> ModelSnapshot | None:
    """Snapshot of the enabled served model ``name`` or ``None`` (unknown, disabled or not a valid name). Raises
    ``ApiError`` 503 ``database_unavailable`` when the lookup cannot reach the database."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return None
    now = time.monotonic()
    hit = _cache.get(name)
    if hit is not None and hit[0] > now:
        _cache.move_to_end(name)
        return hit[1]
    return await _lookups.run(name, lambda: _lookup(name, now), max_age_s=MODEL_CACHE_TTL_S)


async def _lookup(name: str, now: float) -> ModelSnapshot | None:
    """Read ``name``'s registry row and cache its snapshot until ``now + MODEL_CACHE_TTL_S``."""
    try:
        raw = await database_sync_to_async(served_model_snapshot, thread_sensitive=False)(name)
    except DatabaseError:
        raise database_unavailable() from None
    snap = ModelSnapshot.from_dict(raw) if raw is not None else None
    if snap is not None and not snap.enabled:
        snap = None
    _cache[name] = (now + MODEL_CACHE_TTL_S, snap)
    _cache.move_to_end(name)
    while len(_cache) > MODEL_CACHE_MAX_ENTRIES:
        _cache.popitem(last=False)
    return snap
