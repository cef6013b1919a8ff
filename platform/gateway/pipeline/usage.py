"""Step 11 (docs/ARCHITECTURE.md §2): the OpenAI ``usage`` object and the request's usage event, emitted exactly
once whatever the outcome (one XADD to the durable Redis stream; never a DB write on the event loop)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import NotRequired, Protocol, TypedDict

from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError

from gateway.clients import redis, retry_later
from inference.protocol.engine import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from tenancy.selectors import AuthContext
from usage.events import usage_event_emit

log = logging.getLogger(__name__)


class Usage(TypedDict):
    """OpenAI's ``usage`` object."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: NotRequired[dict[str, int]]
    completion_tokens_details: NotRequired[dict[str, int]]


class RunUsage(Protocol):
    """What a usage record reads of a request's engine work (a ``GenerationRun``, an embeddings run): its token
    counts and, as Unix times, its first token and its end (``None``: not yet)."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def first_token_time(self) -> float | None: ...
    @property
    def finished_time(self) -> float | None: ...


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
               reasoning_tokens: int | None = None) -> Usage:
    """OpenAI ``usage`` object (``prompt_tokens_details.cached_tokens`` only when some were cached;
    ``completion_tokens_details.reasoning_tokens`` only when a reasoning parser ran, as vLLM)."""
    usage: Usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def public_finish_reason(reason: str | None) -> str | None:
    """OpenAI exposes only stop/length/tool_calls/content_filter; ``abort`` never reaches a live client."""
    if reason in (FINISH_STOP, FINISH_LENGTH, None):
        return reason
    return FINISH_STOP if reason == FINISH_ABORT else reason


@dataclass
class UsageRecorder:
    """Collects one request's usage and emits it exactly once (``emit`` is idempotent).

    ``ctx``: the caller (``None``: not authenticated, nothing is recorded); ``run``: the request's engine work
    (``RunUsage``); ``None``: nothing ran (0 tokens).
    """

    endpoint: str
    request_id: str
    arrival_time: float
    ctx: AuthContext | None = None
    model: str | None = None
    status_code: int = 200
    finish_reason: str | None = None
    run: RunUsage | None = None
    n: int = 1
    _emitted: bool = False

    def event(self, ctx: AuthContext, now: float) -> dict[str, object]:
        """The usage event of ``ctx``'s request (``usage.events`` schema)."""
        run = self.run
        return {
            "request_id": self.request_id,
            "tenant_id": ctx.tenant_id,
            "api_key_id": ctx.key_id,
            "served_model_name": self.model or "",
            "endpoint": self.endpoint,
            "prompt_tokens": run.prompt_tokens if run else 0,
            "completion_tokens": run.completion_tokens if run else 0,
            "cached_tokens": run.num_cached_tokens if run else 0,
            "status_code": self.status_code,
            "finish_reason": self.finish_reason,
            "ttft_ms": ((run.first_token_time - self.arrival_time) * 1000.0)
            if run and run.first_token_time else None,
            "e2e_latency_ms": ((run.finished_time if run and run.finished_time else now)
                               - self.arrival_time) * 1000.0,
            "n": self.n,
            "created_at": self.arrival_time,
            "finished_at": now,
        }

    async def emit(self) -> None:
        """Send the usage event (once; nothing without an authenticated caller)."""
        if self._emitted or self.ctx is None:
            return
        self._emitted = True
        event = self.event(self.ctx, time.time())
        try:
            await asyncio.shield(usage_event_emit(redis(), event))
        except (RedisConnectionError, RedisTimeoutError, OSError):
            # Redis unreachable (a restart): sent again in the background; a second copy is harmless (the record's
            # request_id is unique, usage/record_insert.py)
            retry_later(lambda: usage_event_emit(redis(), event), f"usage event of {self.request_id}")
        except Exception:  # usage must never break the response
            log.exception("usage event emit failed for %s", self.request_id)
