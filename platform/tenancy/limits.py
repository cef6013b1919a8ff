"""Per-key and per-tenant limits, enforced in Redis, atomically, across every api process.

Django-free: the gateway's hot path imports this module and needs no database access (the limits travel
in the cached ``AuthContext``, see ``tenancy.selectors``).

What is limited, per scope (the key, and the key's tenant; a request must fit in both):

========================  =============================================================================
``rpm``                   requests per minute: token bucket of capacity ``rpm`` refilled at ``rpm/60``/s
``tpm``                   tokens per minute: token bucket of capacity ``tpm`` refilled at ``tpm/60``/s;
                          the request's maximum tokens (prompt + max completion) are taken at admission,
                          the unused part is given back at settle
``max_concurrent``        requests admitted and not settled: a sorted set of leases scored by expiry;
                          a lease of a process that died expires after ``lease_ttl_s`` (crash safety);
                          a live grant renews its lease every ``lease_ttl_s / 3`` seconds
``token_budget``          tokens per calendar period (``day``/``week``/``month``, UTC); reserve-then-settle
                          like TPM, so concurrent requests can never push usage past the budget
========================  =============================================================================

All checks of both scopes and all reservations run in ONE Lua script (all or nothing), so N api
processes enforce exactly the configured limits, not N times them. Token buckets (not fixed windows)
avoid the 2x burst at window edges. Time comes from Redis (``TIME``) so process clocks do not matter.

Headers follow OpenAI (``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``); the scope with
the least remaining capacity is reported. Over a limit: ``RateLimitExceeded`` (HTTP 429) with
``Retry-After``.
"""

from __future__ import annotations

import asyncio
import calendar
import math
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

# A concurrency lease lives this long without a renewal (seconds); a live grant renews it every third of it
# (``_keepalive``), so a process that died frees its slots within ``LEASE_TTL_S`` of its last renewal: inside the
# 10 s the fault drills allow (issue 17, DECISIONS D-181; it was 30 s). Two renewals may be missed, i.e. a loop
# stalled ~4 s, before a live request's slot lapses.
LEASE_TTL_S = 6.0
# 429 codes by the limit that tripped (values of inference.protocol.errors.ErrorCode; this module stays
# importable without the repository root on sys.path, so they are spelled here; tests/test_architecture.py checks)
LIMIT_CODES = {"rpm": "rate_limit_exceeded", "tpm": "rate_limit_exceeded",
               "concurrency": "concurrency_limit_exceeded", "budget": "insufficient_quota"}
BUDGET_PERIODS = ("day", "week", "month")
# How long a grant's settled marker lives by default (seconds; the gateway passes ``LIMITS_SETTLED_MARKER_TTL_S``
# of config/settings.py, at least ``LEASE_TTL_S``). The marker makes
# settling idempotent; the only second settle of a grant is a retry of the same request's exit path (a repeated
# EVAL after a Redis timeout, a second ``finally``), which comes within seconds of the first, while the request
# that holds the grant is still finishing. Any TTL longer than that window, and longer than a lease
# (``LEASE_TTL_S``, so a marker never outlives nothing it guards), is correct. Two minutes covers the gateway's
# background retry of a settle while Redis restarts (60 s, gateway/clients.py ``retry_later``) with margin,
# and keeps two minutes of request rate in markers: Redis's memory is flat from the second minute of steady load
# (10 minutes made it grow for ten: +20 % a minute in bench/soak.py; 24 h kept 86 million keys at 1,000 requests/s).
# DECISIONS D-186.
SETTLED_MARKER_TTL_S = 120.0


@dataclass(frozen=True, slots=True)
class Limits:
    """Limits of one scope (a key or a tenant). ``None`` or 0 = unlimited.

    ``rpm``/``tpm`` per minute; ``max_concurrent`` requests in flight; ``token_budget`` tokens per
    ``budget_period`` (one of ``BUDGET_PERIODS``, calendar UTC).
    """

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    token_budget: int | None = None
    budget_period: str = "month"

    @property
    def is_unlimited(self) -> bool:
        """True when no limit is set."""
        return not (self.rpm or self.tpm or self.max_concurrent or self.token_budget)


UNLIMITED = Limits()


class LimitsContext(Protocol):
    """What ``limits_acquire`` reads from the caller's context (``tenancy.selectors.AuthContext``)."""

    @property
    def key_id(self) -> int: ...
    @property
    def tenant_id(self) -> int: ...
    @property
    def key_limits(self) -> Limits: ...
    @property
    def tenant_limits(self) -> Limits: ...


class RateLimitExceeded(Exception):
    """The request is over one of its key's or tenant's limits: answer HTTP 429.

    ``message`` (human text), ``retry_after_s`` (seconds, int >= 1, for ``Retry-After``), ``headers``
    (list of ``(bytes, bytes)``: ``retry-after`` and the ``x-ratelimit-*`` pairs), ``reason`` (one of
    ``key_rpm``, ``key_tpm``, ``key_concurrency``, ``key_budget``, ``tenant_rpm``, ... — the scope and
    limit that tripped), ``code`` (OpenAI-style error code: ``rate_limit_exceeded`` for RPM/TPM,
    ``concurrency_limit_exceeded`` for concurrency, ``insufficient_quota`` for budgets).
    """

    def __init__(self, message: str, retry_after_s: int, headers: list[tuple[bytes, bytes]], reason: str = "",
                 code: str = "rate_limit_exceeded"):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.headers = headers
        self.reason = reason
        self.code = code

    @property
    def str_headers(self) -> list[tuple[str, str]]:
        """``headers`` as ``(str, str)`` pairs (the form ``gateway.errors.ApiError.headers`` takes)."""
        return [(k.decode(), v.decode()) for k, v in self.headers]


@dataclass(frozen=True, slots=True)
class RateState:
    """One bucket's state after a decision, for headers: limit, remaining, seconds until full."""

    limit: int
    remaining: int
    reset_s: float


@dataclass(slots=True)
class LimitGrant:
    """What ``limits_acquire`` reserved; pass it to ``limits_settle`` exactly once (more calls are no-ops).

    ``reserved_tokens`` counted against TPM and budgets; ``requests``/``tokens`` the header states
    (``None`` when neither scope limits them).
    """

    grant_id: str
    key_id: int
    tenant_id: int
    reserved_tokens: int
    lease_ttl_s: float
    tpm_keys: tuple[str, ...] = ()
    tpm_caps: tuple[int, ...] = ()
    conc_keys: tuple[str, ...] = ()
    budget_keys: tuple[str, ...] = ()
    requests: RateState | None = None
    tokens: RateState | None = None
    settled: bool = False
    _keepalive: asyncio.Task | None = field(default=None, repr=False)

    @property
    def is_noop(self) -> bool:
        """True when nothing was reserved in Redis (no limits apply)."""
        return not (self.tpm_keys or self.conc_keys or self.budget_keys)


# KEYS: per scope (key, tenant) 4 keys: rpm bucket, tpm bucket, concurrency zset, budget counter.
# ARGV[1] cost tokens, ARGV[2] lease id, ARGV[3] lease ttl ms,
# then per scope 5 values: rpm, tpm, max_concurrent, budget, budget key ttl s (0 = unlimited / unused).
# Returns {ok, reason_index, retry_after_ms, then per scope: rpm_rem, rpm_reset_ms, tpm_rem, tpm_reset_ms}.
_ACQUIRE_LUA = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cost = tonumber(ARGV[1])
local lease = ARGV[2]
local lease_ttl = tonumber(ARGV[3])

local function bucket(key, cap)
  local h = redis.call('HMGET', key, 'v', 't')
  local v, ts = tonumber(h[1]), tonumber(h[2])
  if v == nil or ts == nil then return cap end
  local v2 = v + (now_ms - ts) * cap / 60000.0
  if v2 > cap then v2 = cap end
  return v2
end

local state = {}
local fail, fail_retry = 0, 0
for s = 0, 1 do
  local kb = s * 4
  local ab = 3 + s * 5
  local rpm, tpm, conc, budget = tonumber(ARGV[ab+1]), tonumber(ARGV[ab+2]), tonumber(ARGV[ab+3]), tonumber(ARGV[ab+4])
  local st = {rpm_v = 0, tpm_v = 0}
  if rpm > 0 then
    st.rpm_v = bucket(KEYS[kb+1], rpm)
    if fail == 0 and st.rpm_v < 1 then fail = s * 4 + 1; fail_retry = math.ceil((1 - st.rpm_v) * 60000 / rpm) end
  end
  if tpm > 0 then
    st.tpm_v = bucket(KEYS[kb+2], tpm)
    if fail == 0 and st.tpm_v < cost then
      fail = s * 4 + 2
      if cost > tpm then fail_retry = -1 else fail_retry = math.ceil((cost - st.tpm_v) * 60000 / tpm) end
    end
  end
  if conc > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[kb+3], '-inf', now_ms)
    if fail == 0 and redis.call('ZCARD', KEYS[kb+3]) >= conc then
      fail = s * 4 + 3
      fail_retry = 1000
    end
  end
  if budget > 0 then
    local used = tonumber(redis.call('GET', KEYS[kb+4]) or '0')
    if fail == 0 and used + cost > budget then
      fail = s * 4 + 4
      if cost > budget then fail_retry = -1 else fail_retry = tonumber(ARGV[ab+5]) * 1000 end
    end
  end
  state[s] = st
end

local out = {}
if fail == 0 then
  for s = 0, 1 do
    local kb = s * 4
    local ab = 3 + s * 5
    local rpm, tpm, conc, budget = tonumber(ARGV[ab+1]), tonumber(ARGV[ab+2]), tonumber(ARGV[ab+3]), tonumber(ARGV[ab+4])
    if rpm > 0 then
      state[s].rpm_v = state[s].rpm_v - 1
      redis.call('HSET', KEYS[kb+1], 'v', tostring(state[s].rpm_v), 't', now_ms)
      redis.call('PEXPIRE', KEYS[kb+1], 120000)
    end
    if tpm > 0 then
      state[s].tpm_v = state[s].tpm_v - cost
      redis.call('HSET', KEYS[kb+2], 'v', tostring(state[s].tpm_v), 't', now_ms)
      redis.call('PEXPIRE', KEYS[kb+2], 120000)
    end
    if conc > 0 then
      redis.call('ZADD', KEYS[kb+3], now_ms + lease_ttl, lease)
      redis.call('PEXPIRE', KEYS[kb+3], lease_ttl * 4)
    end
    if budget > 0 then
      redis.call('INCRBY', KEYS[kb+4], cost)
      redis.call('EXPIRE', KEYS[kb+4], tonumber(ARGV[ab+5]) + 3600)
    end
  end
end
out[1] = (fail == 0) and 1 or 0
out[2] = fail
out[3] = fail_retry
for s = 0, 1 do
  local ab = 3 + s * 5
  local rpm, tpm = tonumber(ARGV[ab+1]), tonumber(ARGV[ab+2])
  local rv, tv = state[s].rpm_v, state[s].tpm_v
  out[#out+1] = math.floor(math.max(rv, 0))
  out[#out+1] = (rpm > 0) and math.ceil((rpm - rv) * 60000 / rpm) or 0
  out[#out+1] = math.floor(math.max(tv, 0))
  out[#out+1] = (tpm > 0) and math.ceil((tpm - tv) * 60000 / tpm) or 0
end
return out
"""

# KEYS[1] settled marker; then per scope: tpm bucket, concurrency zset, budget counter (6 keys).
# ARGV[1] lease id, ARGV[2] reserved, ARGV[3] actual, ARGV[4] key tpm cap, ARGV[5] tenant tpm cap,
# ARGV[6] marker ttl s. Returns 1 when settled now, 0 when it had been settled already.
_SETTLE_LUA = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', tonumber(ARGV[6])) then return 0 end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local refund = tonumber(ARGV[2]) - tonumber(ARGV[3])
for s = 0, 1 do
  local kb = 1 + s * 3
  local cap = tonumber(ARGV[4 + s])
  if KEYS[kb+1] ~= '' and cap > 0 and refund ~= 0 then
    local h = redis.call('HMGET', KEYS[kb+1], 'v', 't')
    local v, ts = tonumber(h[1]), tonumber(h[2])
    if v ~= nil and ts ~= nil then
      v = v + (now_ms - ts) * cap / 60000.0 + refund
      if v > cap then v = cap end
      redis.call('HSET', KEYS[kb+1], 'v', tostring(v), 't', now_ms)
      redis.call('PEXPIRE', KEYS[kb+1], 120000)
    end
  end
  if KEYS[kb+2] ~= '' then redis.call('ZREM', KEYS[kb+2], ARGV[1]) end
  if KEYS[kb+3] ~= '' and refund ~= 0 and redis.call('EXISTS', KEYS[kb+3]) == 1 then
    local left = redis.call('DECRBY', KEYS[kb+3], refund)
    if left < 0 then redis.call('SET', KEYS[kb+3], 0, 'KEEPTTL') end
  end
end
return 1
"""

# KEYS: concurrency zsets (any number, '' skipped). ARGV[1] lease id, ARGV[2] ttl ms.
_RENEW_LUA = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = 0
for i = 1, #KEYS do
  if KEYS[i] ~= '' then
    n = n + redis.call('ZADD', KEYS[i], 'XX', 'CH', now_ms + tonumber(ARGV[2]), ARGV[1])
    redis.call('PEXPIRE', KEYS[i], tonumber(ARGV[2]) * 4)
  end
end
return n
"""

# KEYS: per scope (key, tenant): tpm bucket, budget counter ('' = unused). ARGV[1] cost tokens, then per scope 3
# values: tpm, budget, budget key ttl s. Returns {ok, reason (1 key tpm, 2 key budget, 3 tenant tpm, 4 tenant
# budget), retry_after_ms, then per scope: tpm_rem, tpm_reset_ms}.
_ADD_TOKENS_LUA = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cost = tonumber(ARGV[1])
local v = {0, 0}
local fail, fail_retry = 0, 0
for s = 0, 1 do
  local tpm, budget = tonumber(ARGV[2 + s*3]), tonumber(ARGV[3 + s*3])
  if tpm > 0 and KEYS[1 + s*2] ~= '' then
    local h = redis.call('HMGET', KEYS[1 + s*2], 'v', 't')
    local b, ts = tonumber(h[1]), tonumber(h[2])
    if b == nil or ts == nil then b = tpm else b = math.min(tpm, b + (now_ms - ts) * tpm / 60000.0) end
    v[s+1] = b
    if fail == 0 and b < cost then
      fail = s * 2 + 1
      if cost > tpm then fail_retry = -1 else fail_retry = math.ceil((cost - b) * 60000 / tpm) end
    end
  end
  if budget > 0 and KEYS[2 + s*2] ~= '' then
    local used = tonumber(redis.call('GET', KEYS[2 + s*2]) or '0')
    if fail == 0 and used + cost > budget then
      fail = s * 2 + 2
      if cost > budget then fail_retry = -1 else fail_retry = tonumber(ARGV[4 + s*3]) * 1000 end
    end
  end
end
if fail == 0 then
  for s = 0, 1 do
    local tpm, budget = tonumber(ARGV[2 + s*3]), tonumber(ARGV[3 + s*3])
    if tpm > 0 and KEYS[1 + s*2] ~= '' then
      v[s+1] = v[s+1] - cost
      redis.call('HSET', KEYS[1 + s*2], 'v', tostring(v[s+1]), 't', now_ms)
      redis.call('PEXPIRE', KEYS[1 + s*2], 120000)
    end
    if budget > 0 and KEYS[2 + s*2] ~= '' then
      redis.call('INCRBY', KEYS[2 + s*2], cost)
      redis.call('EXPIRE', KEYS[2 + s*2], tonumber(ARGV[4 + s*3]) + 3600)
    end
  end
end
local out = {(fail == 0) and 1 or 0, fail, fail_retry}
for s = 0, 1 do
  local tpm = tonumber(ARGV[2 + s*3])
  out[#out+1] = math.floor(math.max(v[s+1], 0))
  out[#out+1] = (tpm > 0) and math.ceil((tpm - v[s+1]) * 60000 / tpm) or 0
end
return out
"""

_REASONS = {
    1: ("key", "rpm"), 2: ("key", "tpm"), 3: ("key", "concurrency"), 4: ("key", "budget"),
    5: ("tenant", "rpm"), 6: ("tenant", "tpm"), 7: ("tenant", "concurrency"), 8: ("tenant", "budget"),
}

_scripts: dict[tuple[str, type], Any] = {}


def _script(redis, name: str, source: str):
    """Call ``source`` on ``redis`` via EVALSHA (loaded on first use, reloaded after SCRIPT FLUSH)."""
    script = _scripts.get((name, type(redis)))
    if script is None:
        script = _scripts[(name, type(redis))] = redis.register_script(source)

    def call(*, keys, args):
        return script(keys=keys, args=args, client=redis)

    return call


def budget_period_bounds(period: str, now: float | None = None) -> tuple[int, int]:
    """``(start, end)`` unix seconds of the calendar UTC ``period`` (day, week from Monday, month) containing
    ``now`` (default ``time.time()``). Raises ``ValueError`` for an unknown period."""
    now = time.time() if now is None else now
    d = datetime.fromtimestamp(now, tz=timezone.utc)
    day0 = datetime(d.year, d.month, d.day, tzinfo=timezone.utc)
    if period == "day":
        start = day0.timestamp()
        return int(start), int(start) + 86_400
    if period == "week":
        start = day0.timestamp() - d.weekday() * 86_400
        return int(start), int(start) + 7 * 86_400
    if period == "month":
        start = datetime(d.year, d.month, 1, tzinfo=timezone.utc).timestamp()
        days = calendar.monthrange(d.year, d.month)[1]
        return int(start), int(start) + days * 86_400
    raise ValueError(f"unknown budget period {period!r} (expected one of {BUDGET_PERIODS})")


def _scope_keys(prefix: str, kind: str, ident: int, limits: Limits, now: float) -> tuple[list[str], list[int]]:
    base = f"{prefix}:lim:{kind}:{ident}"
    budget_key, budget_ttl = "", 0
    if limits.token_budget:
        start, end = budget_period_bounds(limits.budget_period, now)
        budget_key, budget_ttl = f"{base}:budget:{limits.budget_period}:{start}", max(1, int(end - now))
    keys = [f"{base}:rpm", f"{base}:tpm", f"{base}:conc", budget_key or f"{base}:budget:none"]
    args = [int(limits.rpm or 0), int(limits.tpm or 0), int(limits.max_concurrent or 0),
            int(limits.token_budget or 0), budget_ttl]
    return keys, args


def openai_duration(seconds: float) -> str:
    """OpenAI's reset format: ``"20ms"``, ``"1s"``, ``"6m0s"``, ``"1h2m3s"`` (seconds rounded up above 1 s)."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    total = math.ceil(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def _binding(states: list[tuple[int, int, int]]) -> RateState | None:
    """Of ``(limit, remaining, reset_ms)`` per scope with a limit, the one with the least remaining."""
    live = [s for s in states if s[0] > 0]
    if not live:
        return None
    limit, remaining, reset_ms = min(live, key=lambda s: (s[1], -s[2]))
    return RateState(limit=limit, remaining=max(0, min(remaining, limit)), reset_s=reset_ms / 1000.0)


def limits_headers(requests: RateState | None, tokens: RateState | None) -> list[tuple[bytes, bytes]]:
    """OpenAI rate-limit header pairs (lower-case names, ASCII values) for the given states.

    ``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-requests``, ``x-ratelimit-reset-requests`` when
    ``requests`` is set; the same three ``-tokens`` names when ``tokens`` is set. Empty list when neither.
    """
    out: list[tuple[bytes, bytes]] = []
    for suffix, state in (("requests", requests), ("tokens", tokens)):
        if state is None:
            continue
        out.append((f"x-ratelimit-limit-{suffix}".encode(), str(state.limit).encode()))
        out.append((f"x-ratelimit-remaining-{suffix}".encode(), str(state.remaining).encode()))
        out.append((f"x-ratelimit-reset-{suffix}".encode(), openai_duration(state.reset_s).encode()))
    return out


def limits_reservation(prompt_tokens: int, max_completion_tokens: int, n: int = 1) -> int:
    """Tokens to reserve at admission: ``prompt_tokens + n * max_completion_tokens`` (the prompt is counted
    once, as OpenAI bills it; ``max_completion_tokens`` is the request's ``max_tokens`` or, when absent,
    ``max_model_len - prompt_tokens``)."""
    return max(0, int(prompt_tokens)) + max(1, int(n)) * max(0, int(max_completion_tokens))


def grant_headers(grant: LimitGrant) -> list[tuple[bytes, bytes]]:
    """The ``x-ratelimit-*`` header pairs to send with the response of ``grant``'s request."""
    return limits_headers(grant.requests, grant.tokens)


async def _keepalive(redis, grant: LimitGrant) -> None:
    interval = max(0.05, grant.lease_ttl_s / 3.0)
    script = _script(redis, "renew", _RENEW_LUA)
    while not grant.settled:
        await asyncio.sleep(interval)
        if grant.settled:
            return
        try:
            await script(keys=list(grant.conc_keys), args=[grant.grant_id, int(grant.lease_ttl_s * 1000)])
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - Redis blip: the next round retries; the lease has 3 rounds of slack
            continue



def _exceeded(scope: str, what: str, limits: Limits, cost: int, retry_ms: int,
              headers: list[tuple[bytes, bytes]]) -> RateLimitExceeded:
    """The ``RateLimitExceeded`` of ``scope``'s (``key``/``tenant``) limit ``what`` (``rpm``, ``tpm``,
    ``concurrency``, ``budget``) refusing a request of ``cost`` tokens; ``retry_ms`` < 0: never fits."""
    if retry_ms < 0:
        limit = limits.tpm if what == "tpm" else limits.token_budget
        period = "per minute" if what == "tpm" else f"per {limits.budget_period}"
        message = (f"Request too large: it may use up to {cost} tokens, more than this {scope}'s limit of "
                   f"{limit} tokens {period}. Lower max_tokens or the prompt size.")
        retry_s = 0
    else:
        retry_s = max(1, math.ceil(retry_ms / 1000))
        message = {
            "rpm": f"Rate limit reached for this {scope}: {limits.rpm} requests per minute.",
            "tpm": f"Rate limit reached for this {scope}: {limits.tpm} tokens per minute "
                   f"(this request reserves {cost}).",
            "concurrency": f"Too many concurrent requests for this {scope}: limit {limits.max_concurrent}.",
            "budget": f"Token budget exhausted for this {scope}: {limits.token_budget} tokens per "
                      f"{limits.budget_period}.",
        }[what] + f" Retry after {retry_s} s."
    if retry_s:
        headers = [(b"retry-after", str(retry_s).encode()), *headers]
    code = LIMIT_CODES.get(what, "rate_limit_exceeded")
    return RateLimitExceeded(message, retry_s, headers, reason=f"{scope}_{what}", code=code)


async def limits_acquire(redis, prefix: str, ctx: LimitsContext, *, max_tokens_reserved: int,
                         lease_ttl_s: float = LEASE_TTL_S, keepalive: bool = True) -> LimitGrant:
    """Check and reserve one request against ``ctx``'s key and tenant limits, atomically (one Lua call).

    ``redis``: a ``redis.asyncio.Redis`` client; ``prefix``: the platform's ``LINK_PREFIX``;
    ``ctx``: ``AuthContext`` (``key_id``, ``tenant_id``, ``key_limits``, ``tenant_limits``);
    ``max_tokens_reserved``: the most tokens the request can use (prompt + n × max completion tokens),
    taken from TPM and budgets now and settled to the actual count by ``limits_settle``.
    With a concurrency limit the request holds a lease of ``lease_ttl_s`` seconds, renewed by a task of
    this event loop while the grant is unsettled (``keepalive``); a dead process's lease expires.

    Returns a ``LimitGrant`` (no Redis call at all when neither scope has a limit). Raises
    ``RateLimitExceeded`` when any limit of either scope would be exceeded (nothing is reserved then),
    and ``redis.exceptions.RedisError`` when Redis fails.
    """
    key_limits: Limits = getattr(ctx, "key_limits", None) or UNLIMITED
    tenant_limits: Limits = getattr(ctx, "tenant_limits", None) or UNLIMITED
    cost = max(0, int(max_tokens_reserved))
    grant_id = secrets.token_hex(8)
    if key_limits.is_unlimited and tenant_limits.is_unlimited:
        return LimitGrant(grant_id=grant_id, key_id=ctx.key_id, tenant_id=ctx.tenant_id, reserved_tokens=cost,
                          lease_ttl_s=lease_ttl_s)
    now = time.time()
    kkeys, kargs = _scope_keys(prefix, "k", ctx.key_id, key_limits, now)
    tkeys, targs = _scope_keys(prefix, "t", ctx.tenant_id, tenant_limits, now)
    lease_ms = max(1, int(lease_ttl_s * 1000))
    res = await _script(redis, "acquire", _ACQUIRE_LUA)(
        keys=kkeys + tkeys, args=[cost, grant_id, lease_ms, *kargs, *targs])
    ok, fail, retry_ms = int(res[0]), int(res[1]), int(res[2])
    k_rpm_rem, k_rpm_reset, k_tpm_rem, k_tpm_reset, t_rpm_rem, t_rpm_reset, t_tpm_rem, t_tpm_reset = (
        int(x) for x in res[3:11])
    requests = _binding([(kargs[0], k_rpm_rem, k_rpm_reset), (targs[0], t_rpm_rem, t_rpm_reset)])
    tokens = _binding([(kargs[1], k_tpm_rem, k_tpm_reset), (targs[1], t_tpm_rem, t_tpm_reset)])
    if not ok:
        scope, what = _REASONS[fail]
        raise _exceeded(scope, what, key_limits if scope == "key" else tenant_limits, cost, retry_ms,
                        limits_headers(requests, tokens))
    grant = LimitGrant(
        grant_id=grant_id, key_id=ctx.key_id, tenant_id=ctx.tenant_id, reserved_tokens=cost,
        lease_ttl_s=lease_ttl_s,
        tpm_keys=(kkeys[1] if kargs[1] else "", tkeys[1] if targs[1] else ""),
        tpm_caps=(kargs[1], targs[1]),
        conc_keys=(kkeys[2] if kargs[2] else "", tkeys[2] if targs[2] else ""),
        budget_keys=(kkeys[3] if kargs[3] else "", tkeys[3] if targs[3] else ""),
        requests=requests, tokens=tokens,
    )
    if keepalive and any(grant.conc_keys):
        grant._keepalive = asyncio.get_running_loop().create_task(_keepalive(redis, grant))
    return grant



async def limits_add_tokens(redis, prefix: str, ctx: LimitsContext, grant: LimitGrant, tokens: int) -> LimitGrant:
    """Second step of a two-step acquire: reserve ``tokens`` more against TPM and budgets of ``ctx``'s key and
    tenant on ``grant`` (taken by ``limits_acquire``, typically with ``max_tokens_reserved=0`` before the body is
    parsed, so that RPM and concurrency are taken before any work), atomically (one Lua call).

    On success ``grant.reserved_tokens`` grows by ``tokens`` (``limits_settle`` refunds from it) and
    ``grant.tokens`` is the new header state. Raises ``RateLimitExceeded`` (nothing more reserved; the
    grant still holds its request and concurrency slot: settle it) and ``redis.exceptions.RedisError``.
    """
    cost = max(0, int(tokens))
    if cost == 0 or grant.settled or not (any(grant.tpm_keys) or any(grant.budget_keys)):
        return grant
    key_limits: Limits = getattr(ctx, "key_limits", None) or UNLIMITED
    tenant_limits: Limits = getattr(ctx, "tenant_limits", None) or UNLIMITED
    now = time.time()
    _, kargs = _scope_keys(prefix, "k", ctx.key_id, key_limits, now)
    _, targs = _scope_keys(prefix, "t", ctx.tenant_id, tenant_limits, now)
    tpm_keys = list(grant.tpm_keys) or ["", ""]
    budget_keys = list(grant.budget_keys) or ["", ""]
    res = await _script(redis, "add_tokens", _ADD_TOKENS_LUA)(
        keys=[tpm_keys[0], budget_keys[0], tpm_keys[1], budget_keys[1]],
        args=[cost, kargs[1], kargs[3], kargs[4], targs[1], targs[3], targs[4]])
    ok, fail, retry_ms = int(res[0]), int(res[1]), int(res[2])
    k_rem, k_reset, t_rem, t_reset = (int(x) for x in res[3:7])
    tokens_state = _binding([(kargs[1], k_rem, k_reset), (targs[1], t_rem, t_reset)])
    if not ok:
        scope, what = {1: ("key", "tpm"), 2: ("key", "budget"), 3: ("tenant", "tpm"), 4: ("tenant", "budget")}[fail]
        raise _exceeded(scope, what, key_limits if scope == "key" else tenant_limits, cost, retry_ms,
                        limits_headers(grant.requests, tokens_state))
    grant.reserved_tokens += cost
    grant.tokens = tokens_state
    return grant

async def limits_settle(redis, prefix: str, grant: LimitGrant, *, actual_tokens: int,
                        marker_ttl_s: float | None = None) -> bool:
    """Release ``grant``'s concurrency lease and settle TPM and budgets from reserved to ``actual_tokens``.

    Idempotent across calls and processes (a marker ``{prefix}:lim:settled:<grant_id>`` is set in the same
    Lua call, kept ``marker_ttl_s`` seconds, default ``SETTLED_MARKER_TTL_S``): returns True the first time, False
    afterwards. Call it exactly once per successful
    ``limits_acquire``, whatever the request's end (finish, error, client disconnect). ``actual_tokens``
    above the reservation is charged too. Raises ``redis.exceptions.RedisError`` when Redis fails (the
    lease then expires on its own once the keepalive stops).
    """
    if grant.settled:
        return False
    grant.settled = True
    task, grant._keepalive = grant._keepalive, None
    if task is not None and not task.done():
        task.cancel()
    if grant.is_noop:
        return True
    tpm = list(grant.tpm_keys) or ["", ""]
    conc = list(grant.conc_keys) or ["", ""]
    budget = list(grant.budget_keys) or ["", ""]
    caps = list(grant.tpm_caps) or [0, 0]
    keys = [f"{prefix}:lim:settled:{grant.grant_id}", tpm[0], conc[0], budget[0], tpm[1], conc[1], budget[1]]
    res = await _script(redis, "settle", _SETTLE_LUA)(
        keys=keys, args=[grant.grant_id, grant.reserved_tokens, max(0, int(actual_tokens)), caps[0], caps[1],
                         max(1, math.ceil(SETTLED_MARKER_TTL_S if marker_ttl_s is None else marker_ttl_s))])
    return bool(int(res))


async def limits_usage(redis, prefix: str, ctx: LimitsContext) -> dict[str, dict[str, int]]:
    """Current counters for dashboards and tests: ``{"key"|"tenant": {"concurrent", "budget_used"}}``.

    ``concurrent`` counts unexpired leases; ``budget_used`` the tokens charged (reserved or settled) in the
    current budget period (0 without a budget).
    """
    now = time.time()
    out: dict[str, dict[str, int]] = {}
    for scope, kind, ident, limits in (("key", "k", ctx.key_id, ctx.key_limits or UNLIMITED),
                                       ("tenant", "t", ctx.tenant_id, ctx.tenant_limits or UNLIMITED)):
        keys, _ = _scope_keys(prefix, kind, ident, limits, now)
        sec, usec = await redis.time()
        now_ms = int(sec) * 1000 + int(usec) // 1000
        conc = await redis.zcount(keys[2], now_ms, "+inf")
        used = int(await redis.get(keys[3]) or 0) if limits.token_budget else 0
        out[scope] = {"concurrent": int(conc), "budget_used": used}
    return out
