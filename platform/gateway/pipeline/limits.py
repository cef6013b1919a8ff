"""Steps 3 and 6 (docs/ARCHITECTURE.md §2; settled at step 11): the key's and tenant's limits, taken before any render
or image work.

429 is only ever about this key or tenant; platform capacity is 503 (docs/ARCHITECTURE.md §3)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import AsyncIterator

from django.conf import settings

from gateway.model_cache import ModelSnapshot
from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError

from gateway.clients import redis, retry_later
from gateway.errors import redis_unavailable
from gateway.pipeline.failures import api_error_from
from inference.api.admission import estimate_prompt_tokens
from inference.api.cancel_safe import take_or_undo
from gateway.http import GatewayConsumer
from tenancy.limits import (
    LEASE_TTL_S,
    LimitGrant,
    RateLimitExceeded,
    grant_headers,
    limits_acquire,
    limits_add_tokens,
    limits_reservation,
    limits_settle,
)
from tenancy.selectors import AuthContext

log = logging.getLogger(__name__)


def estimate(model: ModelSnapshot, size: int, n: int, max_tokens: int | None, *, exact: bool = False) -> int:
    """Upper bound of the tokens a request can use, known before rendering: ``prompt + n × completion``, where
    the prompt is bounded as the admission pre-check bounds it (``estimate_prompt_tokens(size, max_model_len,
    exact=exact)``: body or prompt bytes plus overhead, or with ``exact`` a token-id prompt's length) and each
    completion by ``max_tokens`` (``None``: the whole context), the total capped at ``n × max_model_len``."""
    max_len = int(model.max_model_len)
    n = max(1, int(n))
    prompt = estimate_prompt_tokens(size, max_len, exact=exact)
    completion = max_len if max_tokens is None else max(0, min(int(max_tokens), max_len))
    return min(limits_reservation(prompt, completion, n), n * max_len)


def estimate_prompts(model: ModelSnapshot, sizes: list[int], n: int, max_tokens: int | None, *,
                     exact: bool = False) -> int:
    """``estimate`` summed over the prompts of a batch of completions prompts (``sizes``: each prompt's bytes,
    or with ``exact`` its token ids), each prompt with its ``n`` completions."""
    return sum(estimate(model, size, n, max_tokens, exact=exact) for size in sizes)


async def acquire(consumer: GatewayConsumer, ctx: AuthContext, tokens: int) -> LimitGrant:
    """Reserve one request against RPM, one concurrency slot, and ``tokens`` against TPM and budgets (Redis,
    atomic, shared by every api process); add the ``x-ratelimit-*`` headers to ``consumer``'s response.
    Returns the grant to ``settle``. Raises ``ApiError`` 429 (``Retry-After`` and ``x-ratelimit-*``). A caller
    cancelled mid-call holds nothing: what the script took is settled in the background."""
    try:
        # cancel-safe: a client gone while the script runs must not keep a concurrency slot and TPM tokens
        grant = await take_or_undo(limits_acquire(redis(), settings.LINK_PREFIX, ctx,
                                                  max_tokens_reserved=limits_reservation(tokens, 0, 1)),
                                   lambda taken: settle(taken, 0))
    except RateLimitExceeded as exc:
        raise api_error_from(exc) from None
    except (RedisConnectionError, RedisTimeoutError):
        # Redis restarting: a 503 the preamble records like a refusal (its usage event is sent once Redis is back)
        raise redis_unavailable() from None
    consumer.extra_headers.extend(grant_headers(grant))
    return grant


async def add_tokens(consumer: GatewayConsumer, ctx: AuthContext, grant: LimitGrant, tokens: int) -> None:
    """Second step of the key limits, once the body is validated: reserve ``tokens`` (the estimate) against
    TPM and budgets on ``grant`` (taken by ``acquire(..., 0)`` right after authentication) and refresh the
    ``x-ratelimit-*`` headers. Raises ``ApiError`` 429; ``grant`` still holds its request and concurrency
    slot then (its owner settles it)."""
    try:
        await limits_add_tokens(redis(), settings.LINK_PREFIX, ctx, grant, limits_reservation(tokens, 0, 1))
    except RateLimitExceeded as exc:
        raise api_error_from(exc) from None
    consumer.extra_headers[:] = [h for h in consumer.extra_headers if not h[0].startswith(b"x-ratelimit-")]
    consumer.extra_headers.extend(grant_headers(grant))


async def settle(grant: LimitGrant | None, actual_tokens: int) -> None:
    """Settle ``grant`` on the tokens really used (no-op for ``None``; never raises: the concurrency lease
    expires by itself if this fails)."""
    if grant is None:
        return
    marker_ttl_s = max(LEASE_TTL_S, settings.LIMITS_SETTLED_MARKER_TTL_S)
    try:
        await asyncio.shield(limits_settle(redis(), settings.LINK_PREFIX, grant, actual_tokens=actual_tokens,
                                           marker_ttl_s=marker_ttl_s))
    except (RedisConnectionError, RedisTimeoutError, OSError):
        # Redis unreachable (a restart): the slot's lease lapses by itself, but the TPM refund and the budget's
        # settlement would be lost; settled again in the background (the settled marker makes it idempotent)
        again = replace(grant, settled=False, _keepalive=None)
        retry_later(lambda: limits_settle(redis(), settings.LINK_PREFIX, again, actual_tokens=actual_tokens,
                                          marker_ttl_s=marker_ttl_s), f"rate-limit settle of {grant.grant_id}")
    except Exception:
        log.exception("rate-limit settle failed")


@asynccontextmanager
async def held(consumer: GatewayConsumer, ctx: AuthContext, tokens: int = 0,
               grant: LimitGrant | None = None) -> AsyncIterator[LimitGrant]:
    """Hold the key's limits around a route that generates nothing (``/tokenize``, render routes, abort):
    ``acquire`` on entry (429, nothing held) unless ``grant`` was taken already (the preamble's), ``settle``
    once on any exit on ``tokens``. Enter it right after authentication, before parsing the body."""
    if grant is None:
        grant = await acquire(consumer, ctx, tokens)
    try:
        yield grant
    finally:
        await settle(grant, tokens)
