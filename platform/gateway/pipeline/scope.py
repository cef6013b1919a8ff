"""What one API request holds that must be given back exactly once, whatever its end (docs/ARCHITECTURE.md §2, its
rules): the engine run (aborted if unfinished), the admission reservation, the key-limit grant and the usage record."""

from __future__ import annotations

import asyncio
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

from tenancy.limits import LimitGrant
from tenancy.selectors import AuthContext

from gateway.errors import ApiError, ErrorCode
from gateway.pipeline import admission, limits
from gateway.clients import background
from gateway.pipeline.usage import RunUsage, UsageRecorder
from inference.api.admission import Reservation


class Run(RunUsage, Protocol):
    """A request's engine work as its scope holds it (``gateway.pipeline.engine.GenerationRun``, the embeddings
    route's ``EmbeddingRun``): the token counts and times of ``RunUsage``, the finish reason its usage record gets
    (the first choice's; ``None`` while unfinished or when the route sets it itself), and ``close()``, which ends
    what is unfinished on the engine (idempotent)."""

    @property
    def finish_reason(self) -> str | None: ...

    async def close(self) -> None: ...


@dataclass
class RequestScope:
    """The request's held resources: set each attribute as soon as it is taken.

    ``reservation``: admission; ``grant``: key limits; ``run``: the engine work; ``priority``: the engine priority of
    its requests (``inference.api.admission.engine_priority``: the key's tier, then the request's own ``priority``)."""

    recorder: UsageRecorder
    priority: int = 0
    reservation: Reservation | None = None
    grant: LimitGrant | None = None
    run: Run | None = None

    @property
    def admitted(self) -> Reservation:
        """The admission reservation (taken by ``flow.hold_before_render``); ``RuntimeError`` before it was taken,
        a step called out of order."""
        if self.reservation is None:
            raise RuntimeError("no admission reservation yet: hold_before_render comes first")
        return self.reservation

    @property
    def holds_nothing(self) -> bool:
        """True before anything was taken (refused at the preamble, or by the key limits)."""
        return self.run is None and self.reservation is None and self.grant is None

    async def release(self) -> None:
        """Give everything back, in order: emit the usage event, close the run (abort unfinished children),
        release admission, settle the key limits on the tokens used (none for ``failed_without_output``). This is
        the one owner of each of these releases (nothing else calls them on a scope's resources); each step is
        idempotent besides.

        The usage event goes first: the answer is already out, and an api process killed during the releases'
        Redis round trips (the many-hosts drill kills one mid-burst) lost the record of a request its client had
        seen answered; the reservation and the key-limit lease it held are reaped anyway."""
        run = self.run
        billed = run is not None and not self.failed_without_output
        if billed:
            self.recorder.run = run
        await self.recorder.emit()
        if run is not None:
            await run.close()
        await admission.release(self.reservation)
        used = (run.prompt_tokens + run.completion_tokens) if run is not None and billed else 0
        await limits.settle(self.grant, used)

    @property
    def failed_without_output(self) -> bool:
        """True when the request failed on the platform's side (a 5xx: no engine replica, the engine failed it)
        before any output token: it is recorded and settled with no tokens, as OpenAI bills no failed request
        (its prompt may have been prefilled, but the caller got nothing for it)."""
        run = self.run
        return self.recorder.status_code >= 500 and run is not None and not run.completion_tokens


# 503s that are failures, not refusals for capacity: recorded with finish reason ``error``
_ENGINE_FAILURES = frozenset({ErrorCode.ENGINE_ERROR, ErrorCode.ENGINE_UNAVAILABLE})


def record_refusal(endpoint: str) -> Callable[[AuthContext, ApiError, str], None]:
    """An ``on_refused`` for ``preamble.preamble``: records the usage event (status of the error, no model, no
    tokens) of a request the key's limits refused before its body was read, in the background (the refusal is
    answered at once). Its ``request_id`` is ``refused-<client id>-<24 hex>`` (``refused-<24 hex>`` without an
    ``X-Request-Id``), unique however often a client repeats its id."""

    def record(ctx: AuthContext, err: ApiError, client_id: str) -> None:
        rid = f"refused-{client_id}-{secrets.token_hex(12)}" if client_id else f"refused-{secrets.token_hex(12)}"
        recorder = UsageRecorder(endpoint, rid, time.time(), ctx, None, status_code=err.status)
        background(recorder.emit())

    return record


@asynccontextmanager
async def request_scope(endpoint: str, request_id: str, arrival: float, ctx: AuthContext, model_name: str | None,
                        n: int, grant: LimitGrant | None = None) -> AsyncIterator[RequestScope]:
    """Run one request's work inside; on exit (success, ``ApiError``, client disconnect) release what it holds
    (``RequestScope.release``), once.

    The usage status is 200, the ``ApiError``'s status (finish reason ``error`` for an engine failure or no live
    replica), or 499 with finish reason ``abort`` when the client went away; else the finish reason is the first
    choice's. ``grant``: the key-limit grant the preamble took (released
    with the rest). A request refused before holding anything emits its usage
    event in the background, so the refusal is answered without waiting for it.
    """
    scope = RequestScope(UsageRecorder(endpoint, request_id, arrival, ctx, model_name, n=n), grant=grant)
    try:
        yield scope
        if scope.run is not None and scope.recorder.finish_reason is None:
            scope.recorder.finish_reason = scope.run.finish_reason
    except ApiError as err:
        scope.recorder.status_code = err.status
        if err.code in _ENGINE_FAILURES:  # an outage, not a capacity refusal: the usage rollups count an error
            scope.recorder.finish_reason = "error"
        raise
    except asyncio.CancelledError:
        scope.recorder.status_code = 499
        scope.recorder.finish_reason = "abort"
        raise
    finally:
        if scope.holds_nothing:
            background(scope.recorder.emit())
        else:
            # On a task of its own: the client may hang up while a 4xx (or the end of a response) is being
            # released, before the answer went out, and the handler's cancellation would then stop the release
            # halfway (usage sent, admission still held for as long as this process lives; D-285).
            await asyncio.shield(background(scope.release()))
