"""Automatic prefix caching for the engine's KV cache (the second identical image request).

A prompt's KV is reusable by any later prompt that starts with the same tokens: vLLM's automatic prefix caching
(docs "Automatic Prefix Caching"; ``vllm/v1/core/kv_cache_utils.py``) splits prompts into blocks of
``block_size`` tokens and names each full block by a hash chained over the blocks before it, with the
multimodal inputs the block covers as extra keys (image placeholder ids are all the same token, so the
image's content key is what tells two images apart). This module keeps that naming but not the paged layout:
the runner's batch cache is contiguous (``runner.py``), so an entry is the contiguous per-layer K/V of one
prompt's full blocks, and every block hash of that prompt points into it. A new prompt walks its own block
hashes and takes the longest run present; any prefix of that run is equally valid (same tokens, same
positions, same images), so the runner may cut it shorter (it keeps the last prompt token to compute; a cut
inside an image's placeholders is fine, the VL runner feeds that image's remaining embeddings).

Bounded by bytes (``capacity_bytes``), least recently used entry evicted first. Two prompts that share a
prefix but were stored separately hold it twice: a paged pool would share the blocks, which is what
transformers' paged cache does, but the runner does not use that layout.

Positions: the cached keys carry their rotary positions; a prefix is only reused at the same positions
(always position 0 onwards), so this holds for RoPE and for M-RoPE (whose positions depend only on the tokens
and images before them).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

# the block naming lives in a torch-free module so the api's router hashes prompts with this very function
from inference.shared.prefix_hash import BLOCK_SIZE, ImageSpan, block_hashes

if TYPE_CHECKING:
    import torch

__all__ = ["BLOCK_SIZE", "DEFAULT_PREFIX_CACHE_MB", "ImageSpan", "PrefixCache", "PrefixEntry", "block_hashes"]

DEFAULT_PREFIX_CACHE_MB = 256


@dataclass(eq=False)
class PrefixEntry:
    """The K/V of one prompt's first ``num_tokens`` tokens: per layer ``(keys, values)``, each
    ``[kv_heads, num_tokens, head_dim]``, contiguous and never modified after insertion."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    num_tokens: int
    nbytes: int
    hashes: list[bytes] = field(default_factory=list)


class PrefixCache:
    """Block-hash → cached K/V of the longest stored prefix; LRU over entries, bounded by ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, block_size: int = BLOCK_SIZE):
        self.capacity_bytes = int(capacity_bytes)
        self.block_size = block_size
        self._index: dict[bytes, tuple[PrefixEntry, int]] = {}
        self._lru: OrderedDict[int, PrefixEntry] = OrderedDict()
        self.bytes_used = 0
        # block hash -> present (True) or gone (False) since the last ``drain_changes``; None: not recorded
        self._journal: dict[bytes, bool] | None = None

    def track_changes(self) -> None:
        """Record which block hashes enter and leave the cache from now on (``drain_changes``), so a replica can
        publish what it holds to the router (``inference/api/router.py``)."""
        if self._journal is None:
            self._journal = {}

    def drain_changes(self) -> tuple[list[bytes], list[bytes]]:
        """``(added, removed)`` block hashes since the last call (each hash in at most one list, by its last
        change), and start over. Empty lists when changes are not tracked."""
        if not self._journal:
            return [], []
        journal, self._journal = self._journal, {}
        return [h for h, v in journal.items() if v], [h for h, v in journal.items() if not v]

    def block_set(self) -> list[bytes]:
        """Every block hash the cache holds now (a full resynchronisation of the published set)."""
        return list(self._index)

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, hashes: list[bytes]) -> tuple[PrefixEntry | None, int]:
        """Longest cached prefix for a prompt with block hashes ``hashes``: (entry, tokens) or (None, 0).
        The entry's first ``tokens`` positions are the prompt's. Marks the entry recently used."""
        for i in range(len(hashes) - 1, -1, -1):
            found = self._index.get(hashes[i])
            if found is not None:
                entry, n = found
                self._lru.move_to_end(id(entry))
                return entry, n
        return None, 0

    def covers(self, hashes: list[bytes]) -> bool:
        """True when the last of ``hashes`` is already stored (inserting again would add nothing)."""
        return bool(hashes) and hashes[-1] in self._index

    def insert(self, hashes: list[bytes], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Store ``kv`` (per layer ``[kv_heads, T, head_dim]`` with ``T >= len(hashes)·block_size``; only the
        first ``len(hashes)·block_size`` positions are kept, copied) under ``hashes``. Evicts least recently
        used entries to stay within capacity; returns False (storing nothing) when the entry alone exceeds it
        or when it is already covered."""
        n = len(hashes) * self.block_size
        if n == 0 or self.covers(hashes):
            return False
        nbytes = sum(2 * k.element_size() * k.shape[0] * n * k.shape[-1] for k, _v in kv)
        if nbytes > self.capacity_bytes:
            return False
        while self.bytes_used + nbytes > self.capacity_bytes and self._lru:
            self._evict(next(iter(self._lru.values())))
        entry = PrefixEntry(kv=[(k[:, :n].clone(), v[:, :n].clone()) for k, v in kv], num_tokens=n, nbytes=nbytes,
                            hashes=list(hashes))
        for i, h in enumerate(hashes):
            self._index[h] = (entry, (i + 1) * self.block_size)
            if self._journal is not None:
                self._journal[h] = True
        self._lru[id(entry)] = entry
        self.bytes_used += nbytes
        return True

    def _evict(self, entry: PrefixEntry) -> None:
        self._lru.pop(id(entry), None)
        self.bytes_used -= entry.nbytes
        for h in entry.hashes:
            found = self._index.get(h)
            if found is not None and found[0] is entry:
                del self._index[h]
                if self._journal is not None:
                    self._journal[h] = False
