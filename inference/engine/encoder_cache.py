"""In-process cache of vision-encoder outputs, keyed by the image's feature-cache key (vLLM's encoder cache).

The same image sent again (same bytes, same processor settings → same ``mm_cache_key``) reuses the image
embeddings the vision tower produced the first time: the engine neither reads the pixels from Redis nor
runs the vision tower again. Bounded by bytes (``ENCODER_CACHE_MAX_BYTES``, default 256 MiB), least
recently used first out. One engine process, one thread: no locking.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch

from inference.shared.config import SETTINGS

DEFAULT_MAX_BYTES = SETTINGS.encoder_cache_max_bytes


class EncodedImage(NamedTuple):
    """One image through the vision tower: ``embeds`` ``[num_tokens, hidden]`` on the model's device, and
    its patch grid ``grid_thw`` ``[t, h, w]`` (needed for the M-RoPE positions)."""

    embeds: torch.Tensor
    grid_thw: list[int]


class EncoderCache:
    """LRU map ``mm_cache_key`` → ``EncodedImage``.

    ``max_bytes`` bounds the summed embedding bytes; an entry larger than the bound is not kept.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_bytes = int(max_bytes)
        self.total_bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, EncodedImage] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> EncodedImage | None:
        """The entry under ``key`` (now most recently used), or ``None``; counts hits and misses."""
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: str, image: EncodedImage) -> None:
        """Keep ``image`` under ``key``, evicting least recently used entries beyond ``max_bytes``."""
        size = _nbytes(image)
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.total_bytes -= _nbytes(old)
        self._entries[key] = image
        self.total_bytes += size
        while self.total_bytes > self.max_bytes:
            _victim, dropped = self._entries.popitem(last=False)
            self.total_bytes -= _nbytes(dropped)


def _nbytes(image: EncodedImage) -> int:
    return image.embeds.nelement() * image.embeds.element_size()
