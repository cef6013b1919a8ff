"""Unit tests of the replica chooser (inference/api/router.py): prefix hit against load, ties, and the hit length read
from the replicas' published block sets, with the engine's own block hashing (inference/shared/prefix_hash.py)."""

from __future__ import annotations

import random

import pytest

from inference.engine.prefix_cache import PrefixCache, block_hashes as cache_block_hashes
from inference.shared.prefix_hash import BLOCK_SIZE, block_hashes
from inference.api.router import (REQUEST_COST_MAX, REQUEST_COST_MIN, REQUEST_COST_TOKENS, ReplicaView, choose_replica,
                              hit_tokens, request_cost_tokens, route_cost)


def test_the_replica_holding_the_prefix_wins_when_loads_are_equal():
    views = [ReplicaView("a"), ReplicaView("b", hit_tokens=992), ReplicaView("c", hit_tokens=64)]
    assert choose_replica(1000, views).engine_id == "b"
    assert route_cost(1000, views[1]) == 8


def test_load_outweighs_a_hit_once_the_queue_there_costs_more_than_the_hit_saves():
    """A hot prefix cannot pile everything onto one replica: queued prompt tokens and requests count against it."""
    hot = ReplicaView("hot", hit_tokens=512, queued_tokens=400, num_requests=3)
    idle = ReplicaView("idle")
    # 600-token prompt: hot costs 88 + 400 + 3·32 = 584, idle 600: stay on the hit
    assert choose_replica(600, [hot, idle]).engine_id == "hot"
    busier = ReplicaView("hot", hit_tokens=512, queued_tokens=600, num_requests=4)
    # 88 + 600 + 128 = 816 > 600: the idle replica, which then caches the prefix too
    assert choose_replica(600, [busier, idle]).engine_id == "idle"


def test_without_any_hit_the_least_loaded_replica_is_chosen():
    views = [ReplicaView("a", queued_tokens=100, num_requests=1), ReplicaView("b", num_requests=2),
             ReplicaView("c", queued_tokens=10, num_requests=0)]
    assert choose_replica(50, views).engine_id == "c"  # costs: 50+100+32, 50+64, 50+10


def test_request_count_is_a_tie_breaker_and_equal_replicas_are_picked_at_random():
    # same cost (the request weight set to 0), fewer requests wins
    views = [ReplicaView("a", queued_tokens=10, num_requests=3), ReplicaView("b", queued_tokens=10, num_requests=1)]
    assert choose_replica(20, views, request_cost_tokens=0).engine_id == "b"
    picks = {choose_replica(20, [ReplicaView("a"), ReplicaView("b")], rng=random.Random(i)).engine_id
             for i in range(20)}
    assert picks == {"a", "b"}


def test_a_dead_replica_is_never_chosen_because_only_live_views_are_offered():
    """The link builds views from live heartbeats only; the chooser refuses an empty choice rather than guess."""
    with pytest.raises(ValueError):
        choose_replica(10, [])
    assert choose_replica(10, [ReplicaView("live", queued_tokens=10_000, num_requests=50)]).engine_id == "live"


def test_request_weight_comes_from_the_replicas_measured_throughputs():
    assert request_cost_tokens([]) == request_cost_tokens([(0.0, 0.0), (5000.0, 0.0)]) == REQUEST_COST_TOKENS
    assert request_cost_tokens([(20_000.0, 100.0), (30_000.0, 100.0), (10_000.0, 100.0)]) == 200.0  # the median
    assert request_cost_tokens([(1.0, 1000.0)]) == REQUEST_COST_MIN
    assert request_cost_tokens([(1e9, 1.0)]) == REQUEST_COST_MAX


def test_hit_tokens_is_the_end_of_the_last_held_block_like_the_cache_lookup():
    assert hit_tokens([], BLOCK_SIZE) == 0
    assert hit_tokens([0, 0, 0], BLOCK_SIZE) == 0
    assert hit_tokens([1, 1, 0], BLOCK_SIZE) == 32
    assert hit_tokens([1, 0, 1], BLOCK_SIZE) == 48  # a chained hash present means its whole prefix is


def test_router_hashes_match_the_engine_prefix_cache_and_its_published_changes():
    """The api hashes prompts with the very function the engine's prefix cache uses; the cache reports the hashes
    it gains and loses (what a replica mirrors into its Redis set), and the hit read from that set equals the
    cache's own lookup."""
    import torch

    assert block_hashes is cache_block_hashes
    system = list(range(100, 164))  # 4 blocks
    turn1, turn2 = system + list(range(500, 540)), system + list(range(500, 540)) + list(range(900, 950))
    cache = PrefixCache(capacity_bytes=1 << 20)
    cache.track_changes()
    h1 = block_hashes(turn1, cache_salt="tenant-a")
    kv = [(torch.zeros(2, len(h1) * BLOCK_SIZE, 4), torch.zeros(2, len(h1) * BLOCK_SIZE, 4))]
    assert cache.insert(h1, kv)
    added, removed = cache.drain_changes()
    assert set(added) == set(h1) and removed == [] and cache.drain_changes() == ([], [])
    published = set(added)
    h2 = block_hashes(turn2, cache_salt="tenant-a")
    assert hit_tokens([h in published for h in h2], BLOCK_SIZE) == cache.lookup(h2)[1] == 96
    other_salt = block_hashes(turn2, cache_salt="tenant-b")
    assert hit_tokens([h in published for h in other_salt], BLOCK_SIZE) == 0
    # eviction leaves the published set too
    entry_bytes = 2 * 4 * 2 * len(h1) * BLOCK_SIZE * 4  # K and V, float32, 2 heads, 96 positions, head_dim 4
    small = PrefixCache(capacity_bytes=entry_bytes + 1)  # room for one entry
    small.track_changes()
    small.insert(h1, kv)
    small.drain_changes()
    other = block_hashes(list(range(2000, 2096)))
    small.insert(other, [(torch.zeros(2, 96, 4), torch.zeros(2, 96, 4))])
    added, removed = small.drain_changes()
    assert set(added) == set(other) and set(removed) == set(h1)
    assert set(small.block_set()) == set(other)
