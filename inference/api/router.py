"""Prefix-aware replica choice (docs/ARCHITECTURE.md §6, §12): which replica of a model serves a generate request.

The api process knows a prompt's token ids before it sends the request, so it can send it to the replica that
already holds the longest part of it in its prefix cache (``inference/engine/prefix_cache.py``: 16-token blocks
named by chained hashes; the router hashes the prompt with that module's own ``block_hashes``). Each replica
publishes the block hashes it holds (a Redis set kept in step with its cache, ``replica_blocks_key``), so the
router's view is the engines' own, shared by every api process. The choice balances the prefill the cache saves
against the work already waiting on the replica, as SGLang's cache-aware router and vLLM's production-stack
router do, in one number of prompt tokens (the unit of prefill work):

    cost(replica) = (prompt tokens - cached there) + queued prompt tokens there + w × requests there

where ``w``, the prefill work one more request in a replica's batch stands for, comes from the replicas' own
measured prefill and decode throughputs (``request_cost_tokens``: on the CPU demo model, whose decode is dominated
by its 151k-entry output layer, a few hundred tokens; on a GPU, other figures),

and the request goes to the replica of least cost. A hot prefix held by one replica therefore stays there only
while that replica's queue is shorter than what the cache saves; beyond that the next request goes to another
replica, which caches the prefix in turn (no pile-up on one replica). A prompt no replica holds goes to the least
loaded one. Ties go to the replica with fewer requests, then at random.

Pure functions, no I/O: ``inference.api.engine_client.EngineLink`` gathers the views (its own in-flight counts, the
replicas' heartbeats, their stream lengths and block sets) and sends.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

# Prompt tokens of prefill work one request waiting or running on a replica is counted as, besides its own queued
# prompt tokens: a request with a cached prefix runs a forward of its own (prefix_cache.py), and every running row
# lengthens each step. Used until the replicas have measured their throughputs (``request_cost_tokens``).
REQUEST_COST_TOKENS = 32.0
REQUEST_COST_MIN, REQUEST_COST_MAX = 16.0, 4096.0


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one live replica for one prompt.

    ``hit_tokens``: prompt tokens the replica holds in its prefix cache (a multiple of the block size);
    ``queued_tokens``: prompt tokens of requests sent to it without a first token yet; ``num_requests``: its
    requests waiting or running.
    """

    engine_id: str
    hit_tokens: int = 0
    queued_tokens: int = 0
    num_requests: int = 0


def route_cost(prompt_len: int, view: ReplicaView, request_cost_tokens: float = REQUEST_COST_TOKENS) -> float:
    """Cost (prompt tokens of prefill work) of sending a ``prompt_len``-token prompt to ``view``'s replica."""
    return max(prompt_len - view.hit_tokens, 0) + view.queued_tokens + request_cost_tokens * view.num_requests


def choose_replica(prompt_len: int, views: Sequence[ReplicaView], *, request_cost_tokens: float = REQUEST_COST_TOKENS,
                   rng: random.Random | None = None) -> ReplicaView:
    """The view of least ``route_cost``; ties: fewer requests, then a random one. Raises ``ValueError`` on no views."""
    if not views:
        raise ValueError("no replica to choose from")
    keyed = [(route_cost(prompt_len, v, request_cost_tokens), v.num_requests) for v in views]
    best = min(keyed)
    tied = [v for v, k in zip(views, keyed) if k == best]
    return tied[0] if len(tied) == 1 else (rng or random).choice(tied)


def with_expected_hit(views: Sequence[ReplicaView], engine_id: str, tokens: int) -> list[ReplicaView]:
    """``views`` with the replica ``engine_id`` counted as holding at least ``tokens`` of the prompt: a stored
    conversation's follow-up names the replica that served its parent (the Responses API's ``previous_response_id``),
    whose cache holds the parent's prompt even before its published block set says so. The choice still weighs that
    saving against the replica's load, as for any hit."""
    return [ReplicaView(v.engine_id, max(v.hit_tokens, tokens), v.queued_tokens, v.num_requests)
            if v.engine_id == engine_id else v for v in views]


def request_cost_tokens(throughputs: Sequence[tuple[float, float]]) -> float:
    """The weight of one request in prompt tokens, from the replicas' measured ``(prefill tokens/s, decode tokens/s)``
    (their heartbeats): one more row in a batch lengthens each step by about ``1 / decode tokens/s`` seconds, the
    time ``prefill / decode`` prompt tokens take to prefill. The median over the replicas that measured both, within
    ``[REQUEST_COST_MIN, REQUEST_COST_MAX]``; ``REQUEST_COST_TOKENS`` when none has."""
    ratios = sorted(p / d for p, d in throughputs if p > 0 and d > 0)
    if not ratios:
        return REQUEST_COST_TOKENS
    return min(max(ratios[len(ratios) // 2], REQUEST_COST_MIN), REQUEST_COST_MAX)


def hit_tokens(present: Sequence[int | bool], block_size: int) -> int:
    """Prompt tokens a replica holds given ``present[i]``, whether it holds the prompt's block ``i`` (SMISMEMBER's
    answer over the prompt's block hashes): the last present block's end, as ``PrefixCache.lookup`` finds it (a
    chained hash present means its whole prefix is)."""
    for i in range(len(present) - 1, -1, -1):
        if present[i]:
            return (i + 1) * block_size
    return 0
