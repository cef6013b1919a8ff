"""Unit tests of the engine's prefix cache: block hashing (tokens, chaining, image keys) and the byte-bounded
LRU. Tensors are real torch tensors; no model is needed."""

from __future__ import annotations

import torch

from inference.engine.prefix_cache import ImageSpan, PrefixCache, block_hashes


def kv(layers: int, tokens: int, fill: float = 1.0):
    """Per-layer K/V of ``tokens`` positions, 2 heads × 4 dims, float32 (64 bytes per position per layer)."""
    return [(torch.full((2, tokens, 4), fill), torch.full((2, tokens, 4), -fill)) for _ in range(layers)]


def test_block_hashes_chain_and_ignore_the_partial_block():
    a = block_hashes(list(range(40)), block_size=16)
    assert len(a) == 2
    b = block_hashes(list(range(32)) + [7] * 8, block_size=16)
    assert b == a  # the trailing partial block is not hashed
    c = block_hashes([99] + list(range(1, 40)), block_size=16)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later hash


def test_image_keys_make_equal_placeholder_runs_differ():
    ids = [5] * 4 + [151655] * 20 + [6] * 8
    one = block_hashes(ids, [ImageSpan(4, 24, "cat")], block_size=16)
    other = block_hashes(ids, [ImageSpan(4, 24, "dog")], block_size=16)
    assert one[0] != other[0] and one[1] != other[1]
    later = block_hashes(list(range(16)) + [151655] * 16, [ImageSpan(16, 32, "cat")], block_size=16)
    later2 = block_hashes(list(range(16)) + [151655] * 16, [ImageSpan(16, 32, "dog")], block_size=16)
    assert later[0] == later2[0] and later[1] != later2[1]  # the block before the image is shared


def test_lookup_gives_the_longest_stored_prefix_and_copies_the_tensors():
    cache = PrefixCache(capacity_bytes=1 << 20, block_size=16)
    ids = list(range(50))
    source = kv(2, 50)
    assert cache.insert(block_hashes(ids), source)
    source[0][0].zero_()  # the cache holds its own copy
    entry, n = cache.lookup(block_hashes(ids[:40] + [1] * 10))
    assert n == 32 and entry.num_tokens == 48 and float(entry.kv[0][0].min()) == 1.0
    assert cache.lookup(block_hashes([1] + ids[1:]))[0] is None
    assert not cache.insert(block_hashes(ids), kv(2, 50))  # already covered


def test_capacity_in_bytes_evicts_least_recently_used():
    per_entry = 2 * 2 * (2 * 32 * 4) * 4  # layers × (K and V) × (heads × tokens × dims) × 4 bytes = 4 KiB
    cache = PrefixCache(capacity_bytes=2 * per_entry, block_size=16)
    prompts = [[p * 1000 + i for i in range(32)] for p in range(3)]
    cache.insert(block_hashes(prompts[0]), kv(2, 32))
    cache.insert(block_hashes(prompts[1]), kv(2, 32))
    assert cache.bytes_used == 2 * per_entry
    cache.lookup(block_hashes(prompts[0]))  # prompt 0 is now the most recently used
    cache.insert(block_hashes(prompts[2]), kv(2, 32))
    assert len(cache) == 2 and cache.bytes_used == 2 * per_entry
    assert cache.lookup(block_hashes(prompts[1]))[0] is None
    assert cache.lookup(block_hashes(prompts[0]))[1] == 32 and cache.lookup(block_hashes(prompts[2]))[1] == 32
    assert not PrefixCache(capacity_bytes=per_entry - 1).insert(block_hashes(prompts[0]), kv(2, 32))
