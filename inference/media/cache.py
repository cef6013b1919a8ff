"""Shared, bounded cache of processed image features in Redis (vLLM's processor cache, ``vllm/multimodal/cache/``).

Key: ``mm_cache_key(image_bytes, processor_settings, cache_salt)`` = SHA-256 over the processor settings
(canonical JSON), the caller's cache salt and the image bytes, so the same image sent twice by one tenant (or
cache group), by any process, is processed once, another tenant's copy is processed and stored on its own
and a change of processor settings never returns stale features.

Layout (all under ``{prefix}:mm:``):

* ``feat:{key}``  msgpack ``{"pixel_values": bytes (float32 LE), "shape": [n, d], "grid_thw": [[t, h, w]],
  "num_tokens": int}``;
* ``meta``  hash key → msgpack ``{"num_tokens", "grid_thw"}``: what the api process needs for a cache hit
  (placeholder expansion), a few bytes instead of the pixels;
* ``lru``  sorted set key → last use (Unix seconds), ``sizes`` hash key → bytes, ``bytes`` total.

Bounded: ``put`` evicts least recently used entries until the total is at most ``max_bytes``
(``MM_CACHE_MAX_BYTES``, default 512 MiB), in one Lua script so concurrent writers from many processes
cannot overshoot or double count. ``get`` refreshes the entry's recency. The engine reads features by key,
so pixels cross Redis once (worker → cache → engine), never through the engine link.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import msgpack
import numpy as np

from inference.shared.config import SETTINGS

if TYPE_CHECKING:
    import redis

DEFAULT_MAX_BYTES = SETTINGS.mm_cache_max_bytes

_PUT_LUA = """
-- KEYS: feat key, lru, sizes, total, meta ; ARGV: value, key id, now, max_bytes, feat prefix, meta value
local size = string.len(ARGV[1])
local old = tonumber(redis.call('HGET', KEYS[3], ARGV[2]) or '0')
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[2], size)
redis.call('HSET', KEYS[5], ARGV[2], ARGV[6])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
local total = redis.call('INCRBY', KEYS[4], size - old)
local maxb = tonumber(ARGV[4])
local evicted = 0
while total > maxb do
  local victim = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not victim or victim == ARGV[2] then break end
  local vs = tonumber(redis.call('HGET', KEYS[3], victim) or '0')
  redis.call('DEL', ARGV[5] .. victim)
  redis.call('ZREM', KEYS[2], victim)
  redis.call('HDEL', KEYS[3], victim)
  redis.call('HDEL', KEYS[5], victim)
  total = redis.call('INCRBY', KEYS[4], -vs)
  evicted = evicted + 1
end
return evicted
"""


def mm_cache_key(image_bytes: bytes, processor_settings: dict[str, Any], cache_salt: str | None = None) -> str:
    """SHA-256 hex of the canonical JSON of ``processor_settings``, the cache salt (when given) and the image
    bytes. The salt (the gateway's per-tenant ``cache_salt``) keeps tenants from sharing, and so
    from probing, each other's processed images; the engine's encoder cache and the prefix cache's image keys
    use this key too, so they are partitioned the same way."""
    h = hashlib.sha256()
    h.update(json.dumps(processor_settings, sort_keys=True, default=str).encode())
    h.update(b"\0")
    if cache_salt:
        h.update(b"salt:" + cache_salt.encode() + b"\0")
    h.update(image_bytes)
    return h.hexdigest()


@dataclass
class ImageFeatures:
    """Processed features of one image: ``pixel_values`` float32 ``[n_patches, patch_dim]``,
    ``grid_thw`` ``[t, h, w]`` (patches), ``num_tokens`` image tokens in the prompt (after the merge)."""

    pixel_values: np.ndarray
    grid_thw: list[int]
    num_tokens: int

    def to_bytes(self) -> bytes:
        """msgpack encoding (see module docstring)."""
        pv = np.ascontiguousarray(self.pixel_values, dtype="<f4")
        data: bytes = msgpack.packb({"pixel_values": pv.tobytes(), "shape": list(pv.shape),
                                     "grid_thw": [int(x) for x in self.grid_thw], "num_tokens": int(self.num_tokens)},
                                    use_bin_type=True)
        return data

    @classmethod
    def from_bytes(cls, raw: bytes) -> ImageFeatures:
        """Inverse of ``to_bytes``."""
        d = msgpack.unpackb(raw, raw=False)
        pv = np.frombuffer(d["pixel_values"], dtype="<f4").reshape(d["shape"])
        return cls(pixel_values=pv, grid_thw=list(d["grid_thw"]), num_tokens=int(d["num_tokens"]))


def feature_meta_key(prefix: str) -> str:
    """Redis hash of the cache entries' metadata (``{prefix}:mm:meta``, field = cache key)."""
    return f"{prefix}:mm:meta"


def feature_meta_decode(raw: bytes) -> dict[str, Any]:
    """``{"num_tokens": int, "grid_thw": [t, h, w]}`` from a ``meta`` hash value."""
    d = msgpack.unpackb(raw, raw=False)
    return {"num_tokens": int(d["num_tokens"]), "grid_thw": [int(x) for x in d["grid_thw"]]}


class FeatureCache:
    """The shared cache over a synchronous ``redis.Redis`` client (workers and engines are synchronous)."""

    def __init__(self, client: redis.Redis, prefix: str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.r = client
        self.prefix = prefix
        self.max_bytes = int(max_bytes)
        self._put = client.register_script(_PUT_LUA)

    def _feat(self, key: str) -> str:
        return f"{self.prefix}:mm:feat:{key}"

    def get(self, key: str) -> ImageFeatures | None:
        """The features under ``key`` (refreshing their recency), or ``None``."""
        raw = self.r.get(self._feat(key))
        if raw is None:
            return None
        self.r.zadd(f"{self.prefix}:mm:lru", {key: time.time()}, xx=True)
        return ImageFeatures.from_bytes(cast(bytes, raw))  # a bytes-mode client

    def get_meta(self, key: str) -> dict[str, Any] | None:
        """``{"num_tokens", "grid_thw"}`` of a cached entry (one small hash field, not the pixels), or
        ``None``; refreshes the entry's recency."""
        raw = self.r.hget(feature_meta_key(self.prefix), key)
        if raw is None:
            return None
        self.r.zadd(f"{self.prefix}:mm:lru", {key: time.time()}, xx=True)
        return feature_meta_decode(cast(bytes, raw))

    def put(self, key: str, feats: ImageFeatures) -> int:
        """Store ``feats`` under ``key``; evict least recently used entries over ``max_bytes``. Returns the
        number of evicted entries."""
        p = self.prefix
        meta = msgpack.packb({"num_tokens": int(feats.num_tokens), "grid_thw": [int(x) for x in feats.grid_thw]})
        return int(self._put(keys=[self._feat(key), f"{p}:mm:lru", f"{p}:mm:sizes", f"{p}:mm:bytes", feature_meta_key(p)],
                             args=[feats.to_bytes(), key, time.time(), self.max_bytes, f"{p}:mm:feat:", meta]))

    def total_bytes(self) -> int:
        """Bytes currently accounted in the cache."""
        return int(self.r.get(f"{self.prefix}:mm:bytes") or 0)
