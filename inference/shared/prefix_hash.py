"""Prefix-cache block naming, shared by the engine's prefix cache (``inference/engine/prefix_cache.py``) and the
api's replica router (``inference/api/router.py``, ``inference/api/engine_client.py``): both must name a prompt's blocks
the same way, so this is the one definition. Torch-free (the api imports it).

vLLM's automatic prefix caching (``vllm/v1/core/kv_cache_utils.py``): a prompt is split into blocks of
``BLOCK_SIZE`` tokens and each full block is named by a hash chained over the blocks before it, with the keys of
the images the block covers and, on the first block, the request's cache salt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BLOCK_SIZE = 16


@dataclass(frozen=True)
class ImageSpan:
    """Image placeholder positions ``[start, end)`` of one image in a prompt, and the image's content key."""

    start: int
    end: int
    key: str


def block_hashes(token_ids: list[int], spans: Sequence[ImageSpan] = (), block_size: int = BLOCK_SIZE,
                 cache_salt: str | None = None) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids``: entry ``i`` names tokens ``[0, (i+1)·block_size)``.

    Block ``i``'s hash covers the previous hash, its ``block_size`` ids (int64) and the keys of the images whose
    spans overlap the block, so equal hashes mean equal tokens and equal images up to that block's end.
    A non-empty ``cache_salt`` is mixed into the first block's hash only (the chain carries it to every later
    block), as vLLM does (``generate_block_hash_extra_keys`` in ``vllm/v1/core/kv_cache_utils.py``): prompts
    with different salts never share a block (tenant isolation).
    A trailing partial block has no hash (it is never reused).
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    out: list[bytes] = []
    prev = b""
    for i in range(len(ids) // block_size):
        lo, hi = i * block_size, (i + 1) * block_size
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(ids[lo:hi].tobytes())
        if i == 0 and cache_salt:
            h.update(b"\x00salt:" + cache_salt.encode())
        for sp in spans:
            if sp.start < hi and sp.end > lo:
                h.update(b"\x00img:" + sp.key.encode())
        prev = h.digest()
        out.append(prev)
    return out
