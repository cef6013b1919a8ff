"""Shared admission control in Redis (docs/ARCHITECTURE.md §3; better than vLLM's, ``AsyncLLM.check_admission`` in
``vllm/v1/engine/async_llm.py``).

Django-free (``redis.asyncio`` for the api processes, plain ``redis`` for the control plane). Every check
and every counter change is one Lua script, so it is atomic across all api processes on all machines and
costs one round trip.

Limits (per served model; published by the control plane into ``{prefix}:adm:m:{model}:limits``, a hash
with optional fields ``max_num_queued_reqs`` and ``max_num_queued_tokens``; an absent field = unbounded).
The scripts read that hash on every check, so an admin change is in force at once in every process.

* ``max_num_queued_reqs``: requests admitted and not finished; ``n`` counts n. Refuse when
  ``queued_reqs + n > limit``, except when nothing at all is admitted for the model (``queued_reqs == 0``
  and limit > 0: a request with ``n`` above the limit could otherwise never run). ``0`` refuses everything
  (an operator's "drain" switch).
* ``max_num_queued_tokens``: prompt tokens of admitted children that have not produced their first token
  (whole prompt, cached or not). The incoming request's own ``n × prompt_tokens`` count (vLLM ignores
  them); refuse when ``queued_tokens > 0 and queued_tokens + n × prompt_tokens > limit``: a request is
  always admissible when no other prompt tokens are queued for the model (otherwise a long prompt could
  never run).

Tiers and fairness (docs/ARCHITECTURE.md §3; operator settings published into the same limits hash), checked after
the hard limits in the same script, so atomic with them:

* Priority tier (``TIER_HIGH`` 0, ``TIER_STANDARD`` 1, ``TIER_LOW`` 2; from the API key's tenant, a key can only
  lower it): each tier may fill ``tier_ceiling_pct:<tier>`` percent of each limit (absent = 100). Lower tiers
  are refused first (reason ``priority_tier``), and the top of each limit stays free for higher tiers. The
  ``queued == 0`` exemptions of the hard limits apply.
* Weighted fair share: the tenants holding reservations for the model share each limit in proportion to
  their weights (``share = weight / Σ active weights``, the caller included). Above
  ``fair_share_threshold_pct`` percent of a limit (absent = 100 = first come, first served), a request is
  refused (reason ``fair_share``) when its tenant would hold more than ``share × limit`` after it; a tenant
  holding nothing is never refused by fairness. So a tenant over its share is refused early, at the soft
  threshold, and the room between the threshold and the limit is left to tenants within their share: the
  refusal falls on the tenant furthest over its share, not on whoever arrives next. Per tenant, the script
  keeps queued requests and tokens and the active weight (``tenants_key``), released with the reservation
  (also by the reaper), and admitted/refused counters (``tenant_counts_key``).

Two steps per request:

1. ``precheck(model, request_id, n, estimated_tokens)`` before the Celery render: a *provisional*
   reservation on an estimate (``estimate_prompt_tokens``: ``len(body bytes)`` capped at ``max_model_len``,
   an upper bound for ordinary templates), so a full queue refuses before any rendering, tokenizing or
   fetching, and a burst cannot all pass an empty queue and then pay for renders (vLLM issue #58192).
2. ``reserve(model, request_id, n, prompt_tokens, reservation=prov)`` after tokenizing: settles the
   reservation to the exact ``n × prompt_tokens`` atomically. Shrinking always succeeds; growing past
   the estimate (only for unusual templates) is checked again and may still refuse.

Release, each exactly once (idempotent both in process and in Redis, because the reservation hash is the
source of truth and counters only move together with it): ``release_prefill(reservation, child)`` at
each child's first output token (its prompt tokens), ``release(reservation)`` at finish / abort / error /
client disconnect (the request slots and any prompt tokens still held).

Crash safety: every reservation belongs to a holder (one per api process and event loop) whose lease, a
score in ``{prefix}:adm:holders``, is refreshed every ``LEASE_REFRESH_S``. Any live process reaps holders
whose lease is older than ``LEASE_TTL_S`` on the same 1 s tick (``reap``), removing their reservations and
correcting the counters in one script: after a ``kill -9`` the counters are true again within
``LEASE_TTL_S + LEASE_REFRESH_S`` (≈ 6 s).

Refusals raise ``AdmissionRefused`` (reason ``max_num_queued_reqs`` / ``max_num_queued_tokens``, a message
naming the limit, ``retry_after_s`` = queued tokens / measured prefill throughput of the model's live
engines, at least 1 s, at most ``RETRY_AFTER_MAX_S``) and are counted per model and reason in Redis.

Redis keys (``{p}`` = LINK_PREFIX): ``{p}:adm:m:{model}:limits|state|refused|ttft|tenants|tcount``,
``{p}:adm:m:{model}:lat:{phase}`` (the TTFT phases' histograms),
``{p}:adm:r:{reservation_id}``, ``{p}:adm:h:{holder}``, ``{p}:adm:holders``, ``{p}:adm:models``.
Scripts build keys from the prefix (not Redis-Cluster safe; one Redis, as docs/ARCHITECTURE.md §1).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, ClassVar, cast

import redis
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline as AsyncPipeline
from redis.client import Pipeline
from redis.typing import EncodableT, FieldT

from inference.api.cancel_safe import take_or_undo
from inference.shared.config import SETTINGS
from inference.protocol.engine import EngineStats, live_replica_keys, replicas_index_key

log = logging.getLogger(__name__)

LEASE_TTL_S = SETTINGS.admission_lease_ttl_s
LEASE_REFRESH_S = SETTINGS.admission_lease_refresh_s
RETRY_AFTER_MAX_S = SETTINGS.admission_retry_after_max_s
THROUGHPUT_CACHE_S = 1.0
ESTIMATE_OVERHEAD_TOKENS = 16

REASON_REQS = "max_num_queued_reqs"
REASON_TOKENS = "max_num_queued_tokens"
REASON_TIER = "priority_tier"
REASON_FAIR = "fair_share"
REASONS = (REASON_REQS, REASON_TOKENS, REASON_TIER, REASON_FAIR)

# Priority tiers (lower = more important; vLLM's convention for ``priority``). The tier comes from the API key's
# tenant (or the key, only ever lower), never from the request. ``TIER_STRIDE``: engine priorities of one tier
# span ``[tier × TIER_STRIDE, (tier + 1) × TIER_STRIDE)``; a request's own ``priority`` (≥ 0) moves it later
# within its tier only (``engine_priority``).
TIER_HIGH, TIER_STANDARD, TIER_LOW = 0, 1, 2
TIERS = (TIER_HIGH, TIER_STANDARD, TIER_LOW)
TIER_NAMES = {TIER_HIGH: "high", TIER_STANDARD: "standard", TIER_LOW: "low"}
TIER_STRIDE = 1_000_000
RANK_STRIDE = 10_000
FAIR_RANK_MAX = 99

# TTFT histogram bucket upper bounds in seconds (shared in Redis; +Inf implicit).
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0,
                  80.0)


# ------------------------------------------------------------------------------------------------ keys
def limits_key(prefix: str, model: str) -> str:
    """Hash of the model's published limits (fields absent = unbounded)."""
    return f"{prefix}:adm:m:{model}:limits"


def state_key(prefix: str, model: str) -> str:
    """Hash ``reqs``, ``tokens``: the model's queued requests and queued prompt tokens."""
    return f"{prefix}:adm:m:{model}:state"


def refused_key(prefix: str, model: str) -> str:
    """Hash reason → refusal count."""
    return f"{prefix}:adm:m:{model}:refused"


# Phases of the time to first token (``output_processor.FirstTokenLatency``), each a shared histogram in Redis
# beside TTFT's, recorded by the same script; finer low buckets than TTFT's (a render or a queue wait is ms).
LATENCY_PHASES = ("frontend", "queue", "prefill")
PHASE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


def latency_key(prefix: str, model: str, phase: str) -> str:
    """Hash of the shared histogram of one TTFT phase (``LATENCY_PHASES``): as ``ttft_key``'s."""
    return f"{prefix}:adm:m:{model}:lat:{phase}"


def ttft_key(prefix: str, model: str) -> str:
    """Hash of the shared TTFT histogram: ``b<i>`` bucket counts (non-cumulative), ``sum``, ``count``."""
    return f"{prefix}:adm:m:{model}:ttft"


def tenants_key(prefix: str, model: str) -> str:
    """Hash of the tenants holding reservations: ``r:<tenant>`` queued requests, ``t:<tenant>`` queued prompt
    tokens, ``w:<tenant>`` the tenant's weight (the state hash's ``wsum`` is their sum). Fields leave with the
    tenant's last reservation."""
    return f"{prefix}:adm:m:{model}:tenants"


def tenant_counts_key(prefix: str, model: str) -> str:
    """Hash of per-tenant counters: ``a:<tenant>`` admitted, ``x:<tenant>`` refused (any reason)."""
    return f"{prefix}:adm:m:{model}:tcount"


def engine_priority(tier: int, requested: int | None = None, fair_rank: int = 0) -> int:
    """The engine's ``EngineCoreRequest.priority`` (lower runs first) for a request of tier ``tier``, admitted with
    ``fair_rank`` (``Reservation.fair_rank``: 0..``FAIR_RANK_MAX``, how far its tenant is into its weighted share),
    whose body asked for ``requested`` (vLLM's ``priority`` field, ≥ 0, validated at the API):
    ``tier × TIER_STRIDE + fair_rank × RANK_STRIDE + requested`` with ``requested`` capped below ``RANK_STRIDE``.
    So the engine orders by tier, then by how much of its share the tenant held (a tenant within its share
    overtakes a backlog of one above it), then by the request's own wish, then by arrival; a request can only go
    later within its own tier, never into a better one."""
    rank = min(max(int(fair_rank), 0), FAIR_RANK_MAX)
    return int(tier) * TIER_STRIDE + rank * RANK_STRIDE + min(max(int(requested or 0), 0), RANK_STRIDE - 1)


def tier_ceilings_pct(high_tier_reserve_pct: int, low_tier_ceiling_pct: int) -> dict[int, int]:
    """Percent of each admission limit a tier may fill: ``high`` 100; ``standard`` 100 − the reserve kept for
    ``high``; ``low`` the smaller of its own ceiling and standard's. Inputs are clamped to 0..100."""
    reserve = min(100, max(0, int(high_tier_reserve_pct)))
    standard = 100 - reserve
    return {TIER_HIGH: 100, TIER_STANDARD: standard,
            TIER_LOW: min(standard, min(100, max(0, int(low_tier_ceiling_pct))))}


def models_key(prefix: str) -> str:
    """Set of model names admission has seen (for ``/metrics``)."""
    return f"{prefix}:adm:models"


def holders_key(prefix: str) -> str:
    """Sorted set holder → lease expiry (ms, Redis clock)."""
    return f"{prefix}:adm:holders"


# ------------------------------------------------------------------------------------------------ Lua
# Shared check. Returns nil when admissible, else {reason, limit, measure}: the hard limits first (as before
# fairness existed), then the tier's ceiling, then the tenant's weighted share above the soft threshold.
# ``tier``: the caller's priority tier; ``treqs``/``ttoks``: what the caller's tenant holds already (requests as
# counted for its share: see ``Reservation.fair_cost``); ``tn``: what this request adds to ``treqs``; ``share``: the
# tenant's weighted share (0..1] of each limit among the tenants holding reservations (1 = alone / no tenant).
_CHECK = """
local function check(limits_key, reqs, toks, n, add, tier, treqs, ttoks, share, tn)
  local lim = redis.call('HMGET', limits_key, 'max_num_queued_reqs', 'max_num_queued_tokens',
                         'fair_share_threshold_pct', 'tier_ceiling_pct:' .. tier)
  local mr = tonumber(lim[1])
  local mt = tonumber(lim[2])
  local soft = tonumber(lim[3]) or 100
  local ceil = tonumber(lim[4]) or 100
  if mr and reqs + n > mr and not (reqs == 0 and mr > 0) then return {'max_num_queued_reqs', mr, 'reqs'} end
  if mt and add > 0 and toks > 0 and toks + add > mt then return {'max_num_queued_tokens', mt, 'tokens'} end
  if ceil < 100 then
    if mr and reqs > 0 and (reqs + n) * 100 > mr * ceil then
      return {'priority_tier', math.floor(mr * ceil / 100), 'reqs'}
    end
    if mt and add > 0 and toks > 0 and (toks + add) * 100 > mt * ceil then
      return {'priority_tier', math.floor(mt * ceil / 100), 'tokens'}
    end
  end
  if soft < 100 and share < 1 then
    if mr and treqs > 0 and (reqs + n) * 100 > mr * soft and treqs + tn > mr * share then
      return {'fair_share', math.floor(mr * share), 'reqs'}
    end
    if mt and add > 0 and ttoks > 0 and (toks + add) * 100 > mt * soft and ttoks + add > mt * share then
      return {'fair_share', math.floor(mt * share), 'tokens'}
    end
  end
  return nil
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: limits, state, refused, reservation, holder set, holders zset, models set, tenants, tenant counts
# ARGV: n, per-child tokens, holder, lease_ms, reservation id, model, request id, tenant ('' = none), weight, tier,
# fair cost (requests each child counts as in its tenant's share)
# Returns {1, reqs, tokens, fair rank} admitted, {0, reason, limit, reqs, tokens, measure, tenant reqs, tenant tokens}
# refused. Fair rank (0..99, 0 without fairness): 10 × what the tenant holds after admission / its share of the
# limit (tokens when bounded, else requests), the engine's order within a tier (``engine_priority``).
_RESERVE = _CHECK + """
if redis.call('EXISTS', KEYS[4]) == 1 then
  -- already taken: redis-py re-sends a script whose reply timed out (its Retry), so a take that ran is not
  -- counted twice (the reservation hash records it once, and releases it once)
  local st0 = redis.call('HMGET', KEYS[2], 'reqs', 'tokens')
  return {1, tonumber(st0[1]) or 0, tonumber(st0[2]) or 0, 0}
end
local n = tonumber(ARGV[1])
local ptok = tonumber(ARGV[2])
local tenant = ARGV[8]
local weight = tonumber(ARGV[9])
local st = redis.call('HMGET', KEYS[2], 'reqs', 'tokens', 'wsum')
local reqs = tonumber(st[1]) or 0
local toks = tonumber(st[2]) or 0
local wsum = tonumber(st[3]) or 0
local add = n * ptok
local tn = n * (tonumber(ARGV[11]) or 1)
local treqs, ttoks, wold, share = 0, 0, nil, 1
if tenant ~= '' then
  local tv = redis.call('HMGET', KEYS[8], 'r:' .. tenant, 't:' .. tenant, 'w:' .. tenant)
  treqs = tonumber(tv[1]) or 0
  ttoks = tonumber(tv[2]) or 0
  wold = tonumber(tv[3])
  local others = wsum - (wold or 0)
  if others > 0 then share = weight / (others + weight) end
end
local bad = check(KEYS[1], reqs, toks, n, add, ARGV[10], treqs, ttoks, share, tn)
if bad then
  redis.call('HINCRBY', KEYS[3], bad[1], 1)
  if tenant ~= '' then redis.call('HINCRBY', KEYS[9], 'x:' .. tenant, 1) end
  return {0, bad[1], bad[2], reqs, toks, bad[3], treqs, ttoks}
end
redis.call('HINCRBY', KEYS[2], 'reqs', n)
redis.call('HINCRBY', KEYS[2], 'tokens', add)
local fields = {'model', ARGV[6], 'holder', ARGV[3], 'reqs', n, 'ptok', ptok, 'tokens', add, 'rid', ARGV[7],
                'tenant', tenant, 'treqs', tn}
for i = 0, n - 1 do
  fields[#fields + 1] = 'c' .. i
  fields[#fields + 1] = 1
end
redis.call('HSET', KEYS[4], unpack(fields))
if tenant ~= '' then
  redis.call('HINCRBY', KEYS[8], 'r:' .. tenant, tn)
  redis.call('HINCRBY', KEYS[8], 't:' .. tenant, add)
  if wold ~= weight then
    redis.call('HSET', KEYS[8], 'w:' .. tenant, weight)
    redis.call('HINCRBY', KEYS[2], 'wsum', weight - (wold or 0))
  end
  redis.call('HINCRBY', KEYS[9], 'a:' .. tenant, 1)
end
redis.call('SADD', KEYS[5], ARGV[5])
redis.call('ZADD', KEYS[6], now_ms() + tonumber(ARGV[4]), ARGV[3])
redis.call('SADD', KEYS[7], ARGV[6])
local rank = 0
if tenant ~= '' then
  local lim = redis.call('HMGET', KEYS[1], 'max_num_queued_reqs', 'max_num_queued_tokens', 'fair_share_threshold_pct')
  local mr, mt, soft = tonumber(lim[1]), tonumber(lim[2]), tonumber(lim[3]) or 100
  local frac = nil
  if soft < 100 and mt and mt > 0 then frac = (ttoks + add) / (mt * share)
  elseif soft < 100 and mr and mr > 0 then frac = (treqs + tn) / (mr * share) end
  if frac then rank = math.min(99, math.floor(frac * 10)) end
end
return {1, reqs + n, toks + add, rank}
"""

# Release everything a reservation still holds. Used by RELEASE, SETTLE and REAP.
_RELEASE_FN = """
local function release_res(prefix, rid)
  local rkey = prefix .. ':adm:r:' .. rid
  local v = redis.call('HMGET', rkey, 'model', 'holder', 'reqs', 'tokens', 'tenant', 'treqs')
  if not v[1] then return 0 end
  local skey = prefix .. ':adm:m:' .. v[1] .. ':state'
  redis.call('HINCRBY', skey, 'reqs', 0 - tonumber(v[3]))
  redis.call('HINCRBY', skey, 'tokens', 0 - tonumber(v[4]))
  local t = v[5]
  if t and t ~= '' then
    local tkey = prefix .. ':adm:m:' .. v[1] .. ':tenants'
    local left = redis.call('HINCRBY', tkey, 'r:' .. t, 0 - tonumber(v[6] or v[3]))
    redis.call('HINCRBY', tkey, 't:' .. t, 0 - tonumber(v[4]))
    if left <= 0 then
      local w = tonumber(redis.call('HGET', tkey, 'w:' .. t)) or 0
      redis.call('HDEL', tkey, 'r:' .. t, 't:' .. t, 'w:' .. t)
      redis.call('HINCRBY', skey, 'wsum', 0 - w)
    end
  end
  redis.call('DEL', rkey)
  redis.call('SREM', prefix .. ':adm:h:' .. v[2], rid)
  return 1
end
"""

# ARGV: prefix, reservation id. Returns 1 when something was released, 0 when already released/reaped.
_RELEASE = _RELEASE_FN + """
return release_res(ARGV[1], ARGV[2])
"""

# ARGV: prefix, reservation id, child index, ttft seconds ('' = none), number of TTFT bounds, number of phase
# bounds, number of phases P, then P pairs (phase name, seconds), the TTFT bounds, the phase bounds.
# Releases the child's prompt tokens once; records TTFT and its phases in the shared histograms when given.
_RELEASE_PREFILL = """
local function observe(hkey, value, first, last)
  local x = tonumber(value)
  local idx = last - first + 1
  for i = first, last do
    if x <= tonumber(ARGV[i]) then idx = i - first break end
  end
  redis.call('HINCRBY', hkey, 'b' .. idx, 1)
  redis.call('HINCRBY', hkey, 'count', 1)
  redis.call('HINCRBYFLOAT', hkey, 'sum', value)
end
local prefix = ARGV[1]
local rkey = prefix .. ':adm:r:' .. ARGV[2]
local model = redis.call('HGET', rkey, 'model')
if not model then return 0 end
if ARGV[4] ~= '' then
  local nt, np, nphase = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
  local tb = 8 + 2 * nphase
  local mkey = prefix .. ':adm:m:' .. model
  observe(mkey .. ':ttft', ARGV[4], tb, tb + nt - 1)
  for j = 0, nphase - 1 do
    observe(mkey .. ':lat:' .. ARGV[8 + 2 * j], ARGV[9 + 2 * j], tb + nt, tb + nt + np - 1)
  end
end
if redis.call('HDEL', rkey, 'c' .. ARGV[3]) == 0 then return 0 end
local rv = redis.call('HMGET', rkey, 'ptok', 'tenant')
local ptok = tonumber(rv[1])
redis.call('HINCRBY', rkey, 'tokens', 0 - ptok)
redis.call('HINCRBY', prefix .. ':adm:m:' .. model .. ':state', 'tokens', 0 - ptok)
if rv[2] and rv[2] ~= '' then
  redis.call('HINCRBY', prefix .. ':adm:m:' .. model .. ':tenants', 't:' .. rv[2], 0 - ptok)
end
return 1
"""

# Settle a provisional reservation to the exact per-child prompt length. Growing past the estimate rechecks the
# hard limits only (the tier and fair-share checks were passed on the estimate, an upper bound as a rule).
# KEYS: limits, state, refused. ARGV: prefix, reservation id, exact per-child tokens, model.
# Returns {1, reqs, tokens} settled, {0, reason, limit, reqs, tokens} refused (reservation released),
# {-1} when the reservation no longer exists (reaped).
_SETTLE = _CHECK + _RELEASE_FN + """
local prefix = ARGV[1]
local rid = ARGV[2]
local rkey = prefix .. ':adm:r:' .. rid
local v = redis.call('HMGET', rkey, 'reqs', 'ptok', 'tokens', 'tenant')
if not v[1] then return {-1} end
local n = tonumber(v[1])
local old = tonumber(v[3])
local exact = tonumber(ARGV[3])
local pending = 0
for i = 0, n - 1 do
  if redis.call('HEXISTS', rkey, 'c' .. i) == 1 then pending = pending + 1 end
end
local new = pending * exact
local st = redis.call('HMGET', KEYS[2], 'reqs', 'tokens')
local reqs = tonumber(st[1]) or 0
local toks = tonumber(st[2]) or 0
if new > old then
  local others = toks - old
  local bad = check(KEYS[1], 0, others, 0, new, '0', 0, 0, 1, 0)
  if bad then
    redis.call('HINCRBY', KEYS[3], bad[1], 1)
    if v[4] and v[4] ~= '' then
      redis.call('HINCRBY', prefix .. ':adm:m:' .. ARGV[4] .. ':tcount', 'x:' .. v[4], 1)
    end
    release_res(prefix, rid)
    return {0, bad[1], bad[2], reqs - n, others, bad[3], 0, 0}
  end
end
redis.call('HSET', rkey, 'ptok', exact, 'tokens', new)
redis.call('HINCRBY', KEYS[2], 'tokens', new - old)
if v[4] and v[4] ~= '' then
  redis.call('HINCRBY', prefix .. ':adm:m:' .. ARGV[4] .. ':tenants', 't:' .. v[4], new - old)
end
return {1, reqs, toks + new - old}
"""

# ARGV: prefix, max holders per call. Reaps holders whose lease expired; returns reservations removed.
_REAP = _RELEASE_FN + """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local hkey = ARGV[1] .. ':adm:holders'
local dead = redis.call('ZRANGEBYSCORE', hkey, '-inf', now_ms, 'LIMIT', 0, tonumber(ARGV[2]))
local removed = 0
for _, holder in ipairs(dead) do
  local skey = ARGV[1] .. ':adm:h:' .. holder
  for _, rid in ipairs(redis.call('SMEMBERS', skey)) do
    removed = removed + release_res(ARGV[1], rid)
  end
  redis.call('DEL', skey)
  redis.call('ZREM', hkey, holder)
end
return removed
"""

# ARGV: holder, lease_ms. KEYS: holders zset.
_REFRESH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return now
"""


# ------------------------------------------------------------------------------------------------ types
class AdmissionRefused(Exception):
    """The request does not fit the model's admission limits (HTTP 503 + ``Retry-After``).

    ``reason``: ``max_num_queued_reqs`` or ``max_num_queued_tokens`` (the hard limits), ``priority_tier`` (the
    caller's tier may fill only part of the limit), ``fair_share`` (above the soft threshold, the caller's tenant
    is over its weighted share); ``limit``: the value hit (the limit, the tier's ceiling or the tenant's share, in
    ``measure``: ``reqs`` or ``tokens``); ``queued_reqs`` / ``queued_tokens``: the model's counters when refused;
    ``retry_after_s``: whole seconds ≥ 1 (queued tokens / measured prefill tokens per second).
    """

    def __init__(self, model: str, reason: str, limit: int, queued_reqs: int, queued_tokens: int,
                 retry_after_s: int, measure: str = "", tenant_held: int = 0, tier: int = TIER_STANDARD):
        self.model = model
        self.reason = reason
        self.limit = limit
        self.queued_reqs = queued_reqs
        self.queued_tokens = queued_tokens
        self.retry_after_s = retry_after_s
        self.measure = measure
        unit = "requests" if measure == "reqs" else "prompt tokens"
        if reason == REASON_REQS:
            what = (f"the queue of model '{model}' is full: {queued_reqs} requests are queued or running "
                    f"and max_num_queued_reqs is {limit}")
        elif reason == REASON_TIER:
            held = queued_reqs if measure == "reqs" else queued_tokens
            what = (f"model '{model}' has {held} {unit} queued and admits requests of the "
                    f"'{TIER_NAMES.get(tier, tier)}' priority tier up to {limit} (the rest is kept for higher tiers)")
        elif reason == REASON_FAIR:
            what = (f"model '{model}' is busy and this tenant holds {tenant_held} queued {unit}; with this request it "
                    f"would exceed its weighted share of {limit}, so other tenants' requests go first")
        else:
            what = (f"the prefill backlog of model '{model}' is full: {queued_tokens} prompt tokens are "
                    f"waiting for their first token and max_num_queued_tokens is {limit}")
        super().__init__(f"Server overloaded: {what}. Retry after {retry_after_s} s.")

    @property
    def message(self) -> str:
        """Human-readable message naming the limit that was hit."""
        return str(self)


@dataclass
class Reservation:
    """One API request's admission reservation (``n`` children of ``prompt_tokens`` each).

    ``tenant`` (the caller's tenant id, ``""`` = none: no fairness accounting), ``weight`` (its fair-share
    weight ≥ 1) and ``tier`` (its priority tier) come from the API key, never from the request body;
    ``fair_cost`` (≥ 1): the requests each child counts as in its tenant's share of ``max_num_queued_reqs``, and in
    its fair rank (a request with an output constraint costs every step a token mask: ``STRUCTURED_FAIR_SHARE_WEIGHT``;
    the model's own request count is ``n`` whatever the cost); ``fair_rank`` is set when admitted (see
    ``engine_priority``).

    ``reservation_id`` keys the Redis hash; ``provisional`` is True until ``reserve`` settled it to the
    exact prompt length. Release methods on ``Admission`` are idempotent per reservation and child.
    """

    model: str
    request_id: str
    n: int
    prompt_tokens: int
    reservation_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    tenant: str = ""
    weight: int = 1
    tier: int = TIER_STANDARD
    fair_cost: int = 1
    fair_rank: int = 0
    provisional: bool = False
    prefill_released: set[int] = field(default_factory=set)
    released: bool = False


def estimate_prompt_tokens(body_len: int, max_model_len: int, *, exact: bool = False) -> int:
    """Upper-bound estimate of a request's prompt tokens before rendering: ``min(max_model_len, body
    bytes + ESTIMATE_OVERHEAD_TOKENS)``.

    A BPE token covers at least one byte of text, and the JSON around messages (``{"role":..,
    "content":..}``) outweighs the template's added special tokens for ordinary templates; a prompt longer
    than ``max_model_len`` is refused with 400 anyway. Over-estimates are corrected by ``reserve`` right
    after tokenizing (milliseconds later). ``exact=True``: ``body_len`` is already the prompt's token count
    (token-id prompts), only capped.
    """
    return max(1, min(int(max_model_len), int(body_len) + (0 if exact else ESTIMATE_OVERHEAD_TOKENS)))


def retry_after_for(queued_tokens: int, prefill_tokens_per_s: float) -> int:
    """``Retry-After`` seconds: the backlog's drain time at the measured prefill rate, clamped to
    ``[1, RETRY_AFTER_MAX_S]`` (1 s when no throughput was measured yet)."""
    if prefill_tokens_per_s <= 0 or queued_tokens <= 0:
        return 1
    return int(min(RETRY_AFTER_MAX_S, max(1, math.ceil(queued_tokens / prefill_tokens_per_s))))


# ------------------------------------------------------------------------------------------------ async side
@dataclass
class Admission:
    """Api-process side of shared admission. Create with ``Admission.for_current_process``.

    One per process and event loop; it is a lease holder and runs one background task that refreshes the
    lease and reaps dead holders every ``LEASE_REFRESH_S``.
    """

    redis: aioredis.Redis
    prefix: str
    holder: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    _task: asyncio.Task[None] | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _throughput: dict[str, tuple[float, float]] = field(default_factory=dict)

    _instances: ClassVar[dict[int, Admission]] = {}

    def __post_init__(self) -> None:
        r = self.redis
        self._reserve = r.register_script(_RESERVE)
        self._release = r.register_script(_RELEASE)
        self._release_prefill = r.register_script(_RELEASE_PREFILL)
        self._settle = r.register_script(_SETTLE)
        self._reap = r.register_script(_REAP)
        self._refresh = r.register_script(_REFRESH)

    @classmethod
    def for_current_process(cls, redis_url: str, prefix: str) -> Admission:
        """The process's admission client for the running loop (created and started on first use)."""
        loop = asyncio.get_running_loop()
        adm = cls._instances.get(id(loop))
        if adm is None or adm._loop is not loop or adm.prefix != prefix:
            adm = cls(redis=aioredis.Redis.from_url(redis_url, max_connections=256), prefix=prefix)
            adm.start()
            cls._instances[id(loop)] = adm
        return adm

    def start(self) -> None:
        """Start the lease/reaper task on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._lease_loop(), name="admission-lease")

    async def close(self) -> None:
        """Stop the lease task, release this holder's lease (its reservations are reaped at once)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing: the loop's own failure is moot
                pass
        try:
            await self.redis.zadd(holders_key(self.prefix), {self.holder: 0})
            await self.reap()
        finally:
            await self.redis.aclose()

    async def _lease_loop(self) -> None:
        while True:
            try:
                await self._refresh(keys=[holders_key(self.prefix)],
                                    args=[self.holder, int(LEASE_TTL_S * 1000)])
                await self.reap()
            except asyncio.CancelledError:
                raise
            except Exception:  # must survive Redis hiccups
                log.exception("admission lease refresh failed")
            await asyncio.sleep(LEASE_REFRESH_S)

    async def reap(self) -> int:
        """Remove reservations of holders whose lease expired; returns how many were removed."""
        return int(await self._reap(args=[self.prefix, 100]))

    # --------------------------------------------------------------------------------- checks
    async def precheck(self, model: str, request_id: str, n: int, estimated_tokens: int, *, tenant: str = "",
                       weight: int = 1, tier: int = TIER_STANDARD, fair_cost: int = 1) -> Reservation:
        """Provisional reservation of ``n`` requests × ``estimated_tokens`` before rendering, for ``tenant``
        (weight, tier, fair cost: see ``Reservation``).

        Raises ``AdmissionRefused`` when it does not fit (nothing was reserved then).
        """
        res = Reservation(model=model, request_id=request_id, n=int(n), prompt_tokens=int(estimated_tokens),
                          tenant=str(tenant), weight=max(1, int(weight)), tier=int(tier),
                          fair_cost=max(1, int(fair_cost)), provisional=True)
        return await self._take_for_caller(res)

    async def reserve(self, model: str, request_id: str, n: int, prompt_tokens: int, *,
                      reservation: Reservation | None = None, tenant: str = "", weight: int = 1,
                      tier: int = TIER_STANDARD) -> Reservation:
        """Exact reservation of ``n`` requests × ``prompt_tokens`` after tokenizing.

        With ``reservation`` (from ``precheck``) the provisional reservation is settled in place (never
        double counted); without, a fresh one is taken. Raises ``AdmissionRefused`` when it does not fit
        (the provisional reservation is then released). ``tenant``/``weight``/``tier`` are for a fresh one (a
        settled reservation keeps its own).
        """
        if reservation is None:
            res = Reservation(model=model, request_id=request_id, n=int(n), prompt_tokens=int(prompt_tokens),
                              tenant=str(tenant), weight=max(1, int(weight)), tier=int(tier))
            return await self._take_for_caller(res)
        if reservation.released:
            raise RuntimeError("reserve() on a released reservation")
        out = await self._settle(keys=[limits_key(self.prefix, model), state_key(self.prefix, model),
                                       refused_key(self.prefix, model)],
                                 args=[self.prefix, reservation.reservation_id, int(prompt_tokens), model])
        status = int(out[0])
        if status == -1:  # reaped (this process stalled past its lease): take a fresh one
            fresh = Reservation(model=model, request_id=request_id, n=int(n), prompt_tokens=int(prompt_tokens),
                                reservation_id=reservation.reservation_id, tenant=reservation.tenant,
                                weight=reservation.weight, tier=reservation.tier, fair_cost=reservation.fair_cost)
            await self._take_for_caller(fresh)
            reservation.prompt_tokens = fresh.prompt_tokens
            reservation.provisional = False
            return reservation
        if status == 0:
            reservation.released = True
            raise await self._refusal(model, out, reservation.tier)
        reservation.prompt_tokens = int(prompt_tokens)
        reservation.provisional = False
        return reservation

    async def _take_for_caller(self, res: Reservation) -> Reservation:
        """``_take`` that never leaks: a caller cancelled while the script runs gets ``CancelledError`` and
        the reservation, once taken, is released in the background (``cancel_safe.take_or_undo``)."""
        async def take() -> Reservation:
            await self._take(res)
            return res
        return await take_or_undo(take(), self.release)

    async def _take(self, res: Reservation) -> None:
        p, m = self.prefix, res.model
        out = await self._reserve(
            keys=[limits_key(p, m), state_key(p, m), refused_key(p, m), f"{p}:adm:r:{res.reservation_id}",
                  f"{p}:adm:h:{self.holder}", holders_key(p), models_key(p), tenants_key(p, m),
                  tenant_counts_key(p, m)],
            args=[res.n, res.prompt_tokens, self.holder, int(LEASE_TTL_S * 1000), res.reservation_id, m,
                  res.request_id, res.tenant, res.weight, res.tier, res.fair_cost])
        if int(out[0]) != 1:
            res.released = True
            raise await self._refusal(m, out, res.tier)
        res.fair_rank = int(out[3])

    async def _refusal(self, model: str, out: list[Any], tier: int) -> AdmissionRefused:
        def text(v: Any) -> str:
            return v.decode() if isinstance(v, bytes) else str(v)
        reason, measure = text(out[1]), text(out[5])
        limit, reqs, toks = int(out[2]), int(out[3]), int(out[4])
        held = int(out[6]) if measure == "reqs" else int(out[7])
        tps = await self.prefill_throughput(model)
        return AdmissionRefused(model, reason, limit, reqs, toks, retry_after_for(toks, tps), measure=measure,
                                tenant_held=held, tier=tier)

    # --------------------------------------------------------------------------------- releases
    async def release_prefill(self, reservation: Reservation | None, child: int,
                              ttft_s: float | None = None, phases: Mapping[str, float] | None = None) -> None:
        """Release child ``child``'s prompt tokens at its first output token (once; later calls no-op).

        ``ttft_s`` (seconds, first token of the whole request) is recorded in the shared TTFT histogram, and with
        it ``phases`` (``{phase: seconds}``, phases of ``LATENCY_PHASES``; others are ignored) in theirs.
        """
        if reservation is None or reservation.released or child in reservation.prefill_released:
            return
        reservation.prefill_released.add(child)
        pairs = [x for k, v in (phases or {}).items() if k in LATENCY_PHASES for x in (k, repr(float(v)))]
        await self._release_prefill(args=[self.prefix, reservation.reservation_id, int(child),
                                          "" if ttft_s is None else repr(float(ttft_s)), len(TTFT_BUCKETS_S),
                                          len(PHASE_BUCKETS_S), len(pairs) // 2, *pairs, *TTFT_BUCKETS_S,
                                          *PHASE_BUCKETS_S])

    async def release(self, reservation: Reservation | None) -> None:
        """Release everything ``reservation`` still holds (finish, abort, error, disconnect). Idempotent."""
        if reservation is None or reservation.released:
            return
        reservation.released = True
        await self._release(args=[self.prefix, reservation.reservation_id])

    # --------------------------------------------------------------------------------- reads
    async def prefill_throughput(self, model: str) -> float:
        """Sum of ``prefill_tokens_per_s`` over the model's live replicas (cached ``THROUGHPUT_CACHE_S``)."""
        now = time.monotonic()
        hit = self._throughput.get(model)
        if hit is not None and hit[0] > now:
            return hit[1]
        value = await prefill_throughput_async(self.redis, self.prefix, model)
        self._throughput[model] = (now + THROUGHPUT_CACHE_S, value)
        return value

    async def snapshot(self, model: str) -> dict[str, Any]:
        """``model_snapshot`` over the async client."""
        async with self.redis.pipeline(transaction=False) as pipe:
            _snapshot_cmds(pipe, self.prefix, model)
            raw = await pipe.execute()
        return _snapshot_parse(raw)


async def prefill_throughput_async(r: aioredis.Redis, prefix: str, model: str) -> float:
    """Sum of the live replicas' ``prefill_tokens_per_s`` for ``model`` (0.0 when none measured)."""
    ids = await r.zrangebyscore(replicas_index_key(prefix, model), int(time.time() * 1000), "+inf")
    if not ids:
        return 0.0
    values = await r.mget(live_replica_keys(ids, prefix, model))
    return sum((EngineStats.from_wire(cast(bytes, v)).prefill_tokens_per_s for v in values if v), 0.0)


# ------------------------------------------------------------------------------------------------ sync side
def _snapshot_cmds(pipe: Pipeline | AsyncPipeline, prefix: str, model: str) -> None:
    pipe.hgetall(state_key(prefix, model))
    pipe.hgetall(limits_key(prefix, model))
    pipe.hgetall(refused_key(prefix, model))
    pipe.hgetall(ttft_key(prefix, model))
    pipe.hgetall(tenants_key(prefix, model))
    pipe.hgetall(tenant_counts_key(prefix, model))
    for phase in LATENCY_PHASES:
        pipe.hgetall(latency_key(prefix, model, phase))


def _tenants_parse(active: dict[Any, Any], counts: dict[Any, Any]) -> dict[str, dict[str, int]]:
    """``{tenant: {queued_reqs, queued_tokens, weight, admitted, refused}}`` from the two tenant hashes (a tenant
    without reservations has zeros and weight 0)."""
    out: dict[str, dict[str, int]] = {}
    names = {"r": "queued_reqs", "t": "queued_tokens", "w": "weight", "a": "admitted", "x": "refused"}
    for h in (active, counts):
        for k, v in _ints(h).items():
            kind, _, tenant = k.partition(":")
            if kind in names and tenant:
                row = out.setdefault(tenant, dict.fromkeys(names.values(), 0))
                row[names[kind]] = v
    return out


def _ints(h: dict[Any, Any]) -> dict[str, int]:
    return {(k.decode() if isinstance(k, bytes) else k): int(float(v)) for k, v in h.items()}


def _floats(h: dict[Any, Any]) -> dict[str, float]:
    return {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in h.items()}


def _histogram(h: dict[str, float], nbounds: int) -> dict[str, Any]:
    """``{buckets, sum, count}`` of a histogram hash (``b<i>`` non-cumulative counts, ``nbounds`` + 1 of them)."""
    return {"buckets": [int(h.get(f"b{i}", 0)) for i in range(nbounds + 1)], "sum": h.get("sum", 0.0),
            "count": int(h.get("count", 0))}


def _snapshot_parse(raw: list[Any]) -> dict[str, Any]:
    state, limits, refused, ttft, tenants, counts, *phases = raw
    state, limits, refused = _ints(state), _ints(limits), _ints(refused)
    t = _histogram(_floats(ttft), len(TTFT_BUCKETS_S))
    return {
        "queued_reqs": state.get("reqs", 0),
        "queued_tokens": state.get("tokens", 0),
        "max_num_queued_reqs": limits.get(REASON_REQS),
        "max_num_queued_tokens": limits.get(REASON_TOKENS),
        "refused": {reason: refused.get(reason, 0) for reason in REASONS},
        "ttft_buckets": t["buckets"],
        "ttft_sum": t["sum"],
        "ttft_count": t["count"],
        "latency": {phase: _histogram(_floats(h), len(PHASE_BUCKETS_S)) for phase, h in zip(LATENCY_PHASES, phases)},
        "fair_share_threshold_pct": limits.get("fair_share_threshold_pct", 100),
        "tier_ceilings_pct": {tier: limits.get(f"tier_ceiling_pct:{tier}", 100) for tier in TIERS},
        "tenants": _tenants_parse(tenants, counts),
    }


TENANT_SERIES_MAX = 200


def tenant_series(tenants: dict[str, dict[str, int]], cap: int = TENANT_SERIES_MAX) -> list[tuple[str, dict[str, int]]]:
    """``(label, figures)`` per tenant of a snapshot's ``tenants`` for metrics with a bounded label set: the
    ``cap`` tenants of smallest id keep their own label (the tenant id: ids only grow, so the set is stable and
    counters stay monotonic), the rest are summed under ``other``."""
    def order(t: str) -> tuple[int, int | str]:
        return (0, int(t)) if t.isdigit() else (1, t)
    names = sorted(tenants, key=order)
    out = [(t, tenants[t]) for t in names[:cap]]
    if len(names) > cap:
        rest: dict[str, int] = {}
        for t in names[cap:]:
            for k, v in tenants[t].items():
                rest[k] = rest.get(k, 0) + v
        out.append(("other", rest))
    return out


def model_snapshot(r: redis.Redis, prefix: str, model: str) -> dict[str, Any]:
    """The model's live admission state (one pipelined round trip, sync client).

    Returns ``queued_reqs``, ``queued_tokens`` (ints), ``max_num_queued_reqs`` / ``max_num_queued_tokens``
    (int or None = unbounded), ``refused`` ({reason: count}), ``ttft_buckets`` (non-cumulative counts, one
    per ``TTFT_BUCKETS_S`` bound plus +Inf), ``ttft_sum`` (s), ``ttft_count``, ``latency`` ({phase of
    ``LATENCY_PHASES``: {``buckets`` (one per ``PHASE_BUCKETS_S`` bound plus +Inf), ``sum``, ``count``}}),
    ``fair_share_threshold_pct``
    (100 = fairness off), ``tier_ceilings_pct`` ({tier: percent}), ``tenants`` ({tenant id: {queued_reqs,
    queued_tokens, weight, admitted, refused}}; admitted/refused are counts since Redis started).
    """
    with r.pipeline(transaction=False) as pipe:
        _snapshot_cmds(pipe, prefix, model)
        return _snapshot_parse(pipe.execute())


def limits_publish(r: redis.Redis, prefix: str, model: str, max_num_queued_reqs: int | None,
                   max_num_queued_tokens: int | None, *, fair_share_threshold_pct: int = 100,
                   tier_ceilings: dict[int, int] | None = None) -> None:
    """Publish a model's limits (``None`` = unbounded) in one MULTI; in force at the next check.

    ``fair_share_threshold_pct``: above this percent of a limit, a tenant holding more than its weighted share
    is refused (100 = first come, first served); ``tier_ceilings``: {tier: percent of each limit the tier may
    fill} (absent = 100, see ``tier_ceilings_pct``)."""
    with r.pipeline(transaction=True) as pipe:
        key = limits_key(prefix, model)
        pipe.delete(key)
        mapping: dict[FieldT, EncodableT] = {}
        if max_num_queued_reqs is not None:
            mapping[REASON_REQS] = int(max_num_queued_reqs)
        if max_num_queued_tokens is not None:
            mapping[REASON_TOKENS] = int(max_num_queued_tokens)
        if int(fair_share_threshold_pct) < 100:
            mapping["fair_share_threshold_pct"] = max(0, int(fair_share_threshold_pct))
        for tier, pct in (tier_ceilings or {}).items():
            if int(pct) < 100:
                mapping[f"tier_ceiling_pct:{int(tier)}"] = max(0, int(pct))
        if mapping:
            pipe.hset(key, mapping=mapping)
        pipe.sadd(models_key(prefix), model)
        pipe.execute()


def known_models(r: redis.Redis, prefix: str) -> list[str]:
    """Models with admission state or published limits."""
    return sorted(m.decode() if isinstance(m, bytes) else m for m in r.smembers(models_key(prefix)))


def prefill_throughput(r: redis.Redis, prefix: str, model: str) -> float:
    """Sync ``prefill_throughput_async``: summed ``prefill_tokens_per_s`` of the model's live replicas."""
    ids = r.zrangebyscore(replicas_index_key(prefix, model), int(time.time() * 1000), "+inf")
    if not ids:
        return 0.0
    return sum((EngineStats.from_wire(cast(bytes, v)).prefill_tokens_per_s
                for v in r.mget(live_replica_keys(ids, prefix, model)) if v), 0.0)


def reap(r: redis.Redis, prefix: str) -> int:
    """Sync reaper (for tools and tests): remove reservations of holders whose lease expired."""
    return int(r.register_script(_REAP)(args=[prefix, 100]))
