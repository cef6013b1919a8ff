"""Steps 6 and 9-11 (docs/ARCHITECTURE.md §2, §3): shared admission. A cheap pre-check reserves an estimate before
rendering; ``reserve`` settles it to the exact ``n × prompt_tokens`` after tokenizing; ``release`` gives back what is
still held, once. 503 ``server_overloaded`` + ``Retry-After`` when full."""

from __future__ import annotations

import asyncio
import logging

from gateway.model_cache import ModelSnapshot
from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError

from gateway.clients import admission, retry_later
from gateway.pipeline.failures import api_error_from
from inference.api.admission import TIER_STANDARD, AdmissionRefused, Reservation, estimate_prompt_tokens
from inference.shared.config import SETTINGS
from inference.api.output_processor import FirstTokenLatency
from tenancy.selectors import AuthContext

log = logging.getLogger(__name__)

CONSTRAINED_FAIR_COST = max(1, SETTINGS.structured_fair_share_weight)


async def precheck(model: ModelSnapshot, request_id: str, n: int, size: int, exact: bool = False,
                   ctx: AuthContext | None = None, constrained: bool = False) -> Reservation:
    """Provisional reservation before rendering; 503 when refused.

    ``size``: an upper bound of the prompt's tokens known before rendering (the body's or the prompt
    text's bytes, or with ``exact`` the length of a token-id prompt); see ``estimate_prompt_tokens``. ``ctx``: the
    caller, whose tenant, fair-share weight and priority tier admission counts (None: no tenant accounting).
    ``constrained``: the request asks for an output constraint, so each child counts as
    ``STRUCTURED_FAIR_SHARE_WEIGHT`` requests in its tenant's share (``Reservation.fair_cost``).
    """
    try:
        return await admission().precheck(
            model.served_model_name, request_id, n, estimate_prompt_tokens(size, model.max_model_len, exact=exact),
            tenant="" if ctx is None else str(ctx.tenant_id), weight=1 if ctx is None else ctx.fair_share_weight,
            tier=TIER_STANDARD if ctx is None else ctx.priority_tier,
            fair_cost=CONSTRAINED_FAIR_COST if constrained else 1)
    except AdmissionRefused as exc:
        raise api_error_from(exc) from None


async def reserve(reservation: Reservation, n: int, prompt_tokens: int) -> None:
    """Settle ``reservation`` to exactly ``n`` requests × ``prompt_tokens`` each; 503 when refused."""
    try:
        await admission().reserve(reservation.model, reservation.request_id, n, prompt_tokens,
                                  reservation=reservation)
    except AdmissionRefused as exc:
        raise api_error_from(exc) from None


async def release_prefill(reservation: Reservation | None, index: int, latency: FirstTokenLatency | None) -> None:
    """Child ``index`` produced its first token: its prompt tokens leave the prefill backlog, and with the request's
    first token its TTFT and phases (``latency``) go to the shared histograms (never raises: ``release`` at the end
    is the backstop)."""
    if reservation is None or index in reservation.prefill_released:
        return
    try:
        if latency is None:
            await admission().release_prefill(reservation, index)
        else:
            await admission().release_prefill(reservation, index, latency.ttft_s, latency.phases())
    except Exception:
        log.exception("admission prefill release failed")


async def release(reservation: Reservation | None) -> None:
    """Release what ``reservation`` still holds (idempotent; errors are logged, never raised). When Redis is
    unreachable (a restart) the release is retried in the background (``retry_later``): this process's lease stays
    alive, so the reaper would never free it. The lease reaper is the backstop when the process dies."""
    if reservation is None or reservation.released:
        return
    try:
        await asyncio.shield(admission().release(reservation))
    except (RedisConnectionError, RedisTimeoutError, OSError):
        again = Reservation(model=reservation.model, request_id=reservation.request_id, n=reservation.n,
                            prompt_tokens=reservation.prompt_tokens, reservation_id=reservation.reservation_id)
        retry_later(lambda: admission().release(again), f"admission release of {reservation.request_id}")
    except Exception:
        log.exception("admission release failed for %s", reservation.request_id)
