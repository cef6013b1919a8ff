"""Background responses (``background: true``): run in the runner process (``manage.py responses_runner``), never in
the api process that accepted them, so one survives that process's death (``kill -9`` included).

Hand-off. The accepting api stores the response ``queued`` with its job (the validated body, the caller's
``AuthContext`` as it was authenticated, the request's usage id, the parent's replica), writes ``response.created``
and ``response.queued`` to the response's Redis event stream (``responses_api.events_key``) and adds the response id
to the jobs stream (``jobs_key``, consumer group ``runners``). A runner reads it (``XREADGROUP``), moves it
``queued`` → ``in_progress`` (compare-and-set: a cancel before that wins), and runs it like a foreground request
(``conversation.start`` under its own ``request_scope``, then ``responses_api.drive``), appending each event to the
stream (entry id = ``sequence_number`` + 1, so nothing is written twice and a reader resumes exactly after what it
saw). At the end it stores the output, usage and status in one transaction, then appends the terminal event, and
acknowledges the job.

Limits and billing. The accepting api took the request's RPM (its preamble) and dropped its own usage record; the
runner takes the concurrency slot and the token estimate without counting the request again (``runner_context``:
the same caller with no RPM limit), and emits the one usage event under the accepting request's id (a second copy of
an event with that id is dropped by the usage writer). A cancel (``POST .../cancel`` or ``DELETE``) sets a flag that
the runner polls (``CANCEL_POLL_S``): the run's task is cancelled, its engine work aborted by the scope's release, and
the tokens generated so far billed (status 499, as a client that went away).

A runner that dies. Runners keep a liveness key (``RUNNER_TTL_S``); every ``RECLAIM_EVERY_S`` a live runner claims
the pending jobs of consumers whose key lapsed: a job still ``queued`` is run, one ``in_progress`` is failed
(``error`` + ``response.failed``; its engine work was aborted by the engines when the dead runner's link lapsed, and
nothing was billed), one cancelled gets its terminal event.

Why a runner process and not a Celery task: see docs/DECISIONS.md (the Responses API's background mode) and
``bench/responses_background.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, cast

import orjson
from django.conf import settings
from redis.exceptions import ResponseError

from gateway.clients import admission, link, redis
from gateway.errors import ApiError, internal_error
from gateway.http import GatewayConsumer
from gateway.pipeline import conversation
from gateway.pipeline.preamble import Preamble
from gateway.pipeline.scope import request_scope
from gateway.responses_api import (RESPONSES, Outcome, ResponseContext, ResponseRecord, db, drive, final_event,
                                   last_sequence_number, response_error, run_usage, start, stream_emitter)
from inference.api.engine_client import ExpectedHit
from inference.api.responses_input import stored_items
from inference.api.responses_output import ResponseBuilder, response_object
from inference.protocol.responses import (EV_IN_PROGRESS, STATUS_CANCELLED, STATUS_FAILED,
                                          STATUS_IN_PROGRESS, TERMINAL_STATUSES, ResponsesRequest, usage_object,
                                          validate_responses_request)
from stored_responses.models import StoredResponse
from stored_responses.selectors import (stored_response_chain, stored_response_get, stored_response_job,
                                        stored_response_output)
from stored_responses.services import stored_response_finish, stored_response_start
from tenancy.limits import Limits
from tenancy.selectors import AuthContext

log = logging.getLogger(__name__)

GROUP = "runners"
RUNNER_TTL_S = 5
ALIVE_EVERY_S = 1.0
RECLAIM_EVERY_S = 2.0
CANCEL_POLL_S = 0.25
CANCEL_TTL_S = 3600
READ_BLOCK_MS = 1000


def jobs_key() -> str:
    """The Redis stream of background responses to run (field ``id``: the response id)."""
    return f"{settings.LINK_PREFIX}:responses:jobs"


def cancel_key(response_id: str) -> str:
    """Set when the response was cancelled or deleted: its runner stops it."""
    return f"{settings.LINK_PREFIX}:responses:cancel:{response_id}"


def runner_key(name: str) -> str:
    """A runner's liveness key (``RUNNER_TTL_S``)."""
    return f"{settings.LINK_PREFIX}:responses:runner:{name}"


# ----------------------------------------------------------------------------- the accepting api's side


def _ctx_json(ctx: AuthContext) -> dict[str, Any]:
    data = dataclasses.asdict(ctx)
    data["expires_at"] = ctx.expires_at.isoformat() if ctx.expires_at is not None else None
    return data


def runner_context(data: dict[str, Any]) -> AuthContext:
    """The caller as the job stored it, without RPM limits: the accepting api counted the request already."""
    fields = dict(data)
    fields["expires_at"] = datetime.fromisoformat(data["expires_at"]) if data.get("expires_at") else None
    fields["allowed_models"], fields["scopes"] = tuple(data["allowed_models"]), tuple(data["scopes"])
    fields["key_limits"] = Limits(**{**data["key_limits"], "rpm": None})
    fields["tenant_limits"] = Limits(**{**data["tenant_limits"], "rpm": None})
    return AuthContext(**fields)


def job_payload(req: ResponsesRequest, ctx: AuthContext, request_id: str, external_id: str, size: int,
                context: ResponseContext) -> dict[str, Any]:
    """What the runner needs beside the stored response: the validated body, the caller, the request's usage and
    internal ids, the body's size (the estimates' bound) and the parent's replica."""
    expected = [context.expected.engine_id, context.expected.tokens] if context.expected is not None else None
    return {"body": req.model_dump(mode="json", by_alias=True, exclude_none=True), "ctx": _ctx_json(ctx),
            "request_id": request_id, "external_id": external_id, "size": size, "expected": expected}


async def enqueue(response_id: str) -> None:
    """Hand the stored ``queued`` response to a runner."""
    await redis().xadd(jobs_key(), {"id": response_id})


async def cancel_signal(response_id: str) -> None:
    """Tell the runner of ``response_id`` (if any) to stop it."""
    await redis().set(cancel_key(response_id), b"1", ex=CANCEL_TTL_S)


def _body_of(resp: StoredResponse, output: list[dict[str, Any]]) -> dict[str, Any]:
    return response_object(
        response_id=resp.response_id, created_at=resp.created_at.timestamp(), model=resp.model, status=resp.status,
        echo=resp.params, output=output, usage=resp.usage, previous_response_id=resp.previous_response_id or None,
        metadata=resp.metadata, background=resp.background, store=True,
        completed_at=resp.completed_at.timestamp() if resp.completed_at else None, error=resp.error,
        incomplete_details=resp.incomplete_details)


async def stored_body(resp: StoredResponse) -> dict[str, Any]:
    """The ``response`` object of a stored response (its output read from the store)."""
    output = await db(stored_response_output, response=resp)
    return _body_of(resp, output)


def stored_finished(tenant_id: int, response_id: str) -> Callable[[], Awaitable[bool]]:
    """A ``give_up`` for ``responses_api.tail``: True once the response has ended (or is gone), so a reader whose
    events expired, or whose terminal event was never written (a runner that died), is not kept waiting."""

    async def finished() -> bool:
        resp = await db(stored_response_get, tenant_id=tenant_id, response_id=response_id)
        return resp is None or resp.status in TERMINAL_STATUSES

    return finished


# ----------------------------------------------------------------------------- running one job


@dataclasses.dataclass
class Job:
    """One background response being run: its stored row, record, builder and (once started) its run."""

    resp: StoredResponse
    record: ResponseRecord
    builder: ResponseBuilder
    started: conversation.Started | None = None


def _record(resp: StoredResponse) -> ResponseRecord:
    return ResponseRecord(resp.response_id, resp.created_at.timestamp(), resp.model, resp.params,
                          resp.previous_response_id or None, resp.metadata, True, True)


async def _context(resp: StoredResponse, job: dict[str, Any]) -> ResponseContext:
    """The conversation of a queued response: its chain's items, then its own stored input items."""
    chain = await db(stored_response_chain, tenant_id=resp.tenant_id, response_id=resp.response_id)
    if chain is None:
        raise ApiError(404, "The response was deleted before it ran")
    expected = ExpectedHit(*job["expected"]) if job.get("expected") else None
    return ResponseContext(stored_items(chain.items), [], chain.ids[:-1], len(orjson.dumps(chain.items)), expected)


async def _generate(job: Job) -> Outcome:
    """Run the job's response as a foreground request would run (its own scope: limits, admission, usage)."""
    resp = job.resp
    data = cast(dict[str, Any], resp.request)
    req = validate_responses_request(data["body"])
    ctx = runner_context(data["ctx"])
    context = await _context(resp, data)
    arrival = time.time()
    async with request_scope(RESPONSES.endpoint, data["request_id"], arrival, ctx, req.model, 1) as scope:
        # grant None: the scope takes the key's limits at hold_before_render (without RPM: runner_context)
        pre = Preamble(ctx, req, data["external_id"], data["external_id"], cast(Any, None))
        started, _conv = await start(GatewayConsumer(), conversation.Opened(pre, scope, arrival), req, context,
                                     size=int(data["size"]))
        job.started = started
        return await drive(started, req, job.builder, stream_emitter(resp.response_id))


def _cancelled(job: Job) -> Outcome:
    """The outcome of a cancelled job: the tokens generated until the abort."""
    if job.started is None:
        return Outcome(STATUS_CANCELLED, usage_object(0, 0))
    return Outcome(STATUS_CANCELLED, run_usage(job.started, job.started.parsers[0]))


async def _finish(job: Job, outcome: Outcome, error_event: ApiError | None = None) -> None:
    """Store the job's outcome, then append its last events (the store first: a follow-up sent on the terminal
    event finds the response ended)."""
    rid = job.resp.response_id
    started = job.started
    final = await db(stored_response_finish, response_id=rid, status=outcome.status, output_items=job.builder.output,
                     usage=outcome.usage, error=outcome.error, incomplete_details=outcome.incomplete_details,
                     engine_id=(started.run.engine_id or "") if started else "",
                     prompt_tokens=started.run.prompt_tokens if started else 0)
    outcome.status = final if final in TERMINAL_STATUSES else outcome.status
    events = []
    if error_event is not None:
        events.append(job.builder.error(error_event.message, error_event.code, error_event.param))
    events += job.builder.finish(outcome.status) if outcome.status != STATUS_FAILED or job.builder.output else []
    events.append(final_event(job.record, job.builder, outcome))
    await stream_emitter(rid)(events)


async def run_job(response_id: str, running: dict[str, asyncio.Task[Outcome]]) -> None:
    """Run the background response ``response_id`` to its end (module docstring); ``running`` maps it to its task
    while it generates, for the cancel watcher."""
    resp = await db(stored_response_job, response_id=response_id)
    if resp is None or resp.request is None:
        return  # deleted, or run already
    if not await db(stored_response_start, response_id=response_id):
        await fail_orphan(response_id)  # no longer queued: cancelled meanwhile (its terminal event), or orphaned
        return
    job = Job(resp, _record(resp), ResponseBuilder(seq=await last_sequence_number(response_id) + 1))
    await stream_emitter(response_id)([job.builder.lifecycle(EV_IN_PROGRESS, job.record.body(STATUS_IN_PROGRESS,
                                                                                            []))])
    task = running[response_id] = asyncio.get_running_loop().create_task(_generate(job))
    try:
        outcome = await task
    except asyncio.CancelledError:
        if not task.cancelled():
            raise  # the runner itself is stopping: the job stays pending, another runner fails it
        await _finish(job, _cancelled(job))
        return
    except ApiError as err:  # refused before it started (limits, admission, a bad conversation)
        await _finish(job, Outcome(STATUS_FAILED, usage_object(0, 0), error=response_error(err)), err)
        return
    except Exception:
        log.exception("background response %s failed", response_id)
        defect = internal_error()
        await _finish(job, Outcome(STATUS_FAILED, usage_object(0, 0), error=response_error(defect)), defect)
        return
    finally:
        running.pop(response_id, None)
    await _finish(job, outcome)


async def fail_orphan(response_id: str) -> None:
    """A job whose runner died: still ``queued`` it is run by the caller; ``in_progress`` it fails now (its engine
    work ended with that runner's link); cancelled it gets its terminal event."""
    resp = await db(stored_response_job, response_id=response_id)
    if resp is None or resp.status in (TERMINAL_STATUSES - {STATUS_CANCELLED}) or resp.request is None:
        return
    job = Job(resp, _record(resp), ResponseBuilder(seq=await last_sequence_number(response_id) + 1))
    if resp.status == STATUS_CANCELLED:
        await _finish(job, _cancelled(job))
        return
    err = ApiError(503, "The background worker running this response stopped before it finished",
                   code="engine_unavailable")
    await _finish(job, Outcome(STATUS_FAILED, usage_object(0, 0), error=response_error(err)), err)


# ----------------------------------------------------------------------------- the runner process


class ResponsesRunner:
    """One runner process's loop: read jobs (at most ``concurrency`` at once), watch cancels, keep alive, reclaim
    the jobs of dead runners."""

    def __init__(self, concurrency: int = 64, name: str | None = None):
        self.concurrency = concurrency
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.running: dict[str, asyncio.Task[Outcome]] = {}
        self.jobs: set[asyncio.Task[None]] = set()

    async def run_forever(self) -> None:
        """Serve jobs until cancelled."""
        admission()  # this process's admission lease and reaper, as an api process's lifespan starts them
        link()
        try:
            await redis().xgroup_create(jobs_key(), GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        helpers = [asyncio.create_task(loop()) for loop in (self._alive, self._watch_cancels, self._reclaim)]
        try:
            await self._read()
        finally:
            for t in helpers:
                t.cancel()

    async def _read(self) -> None:
        while True:
            free = self.concurrency - len(self.jobs)
            if free <= 0:
                await asyncio.wait(self.jobs, return_when=asyncio.FIRST_COMPLETED)
                continue
            reply: Any = await redis().xreadgroup(GROUP, self.name, {jobs_key(): ">"}, count=free,
                                                  block=READ_BLOCK_MS)
            for _key, entries in reply or []:
                for entry_id, fields in entries:
                    self._spawn(entry_id, fields[b"id"].decode(), orphan=False)

    def _spawn(self, entry_id: Any, response_id: str, *, orphan: bool) -> None:
        async def job() -> None:
            try:
                if orphan:
                    await fail_orphan(response_id)
                await run_job(response_id, self.running)
            except Exception:
                log.exception("background job %s", response_id)
            await redis().xack(jobs_key(), GROUP, entry_id)

        task = asyncio.get_running_loop().create_task(job())
        self.jobs.add(task)
        task.add_done_callback(self.jobs.discard)

    async def _alive(self) -> None:
        while True:
            try:
                await redis().set(runner_key(self.name), b"1", ex=RUNNER_TTL_S)
            except Exception:
                log.warning("runner liveness key not set", exc_info=True)
            await asyncio.sleep(ALIVE_EVERY_S)

    async def _watch_cancels(self) -> None:
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            ids = list(self.running)
            if not ids:
                continue
            try:
                flags = await redis().mget([cancel_key(i) for i in ids])
            except Exception:  # noqa: BLE001 - Redis restarting: the next poll sees it
                continue
            for rid, flag in zip(ids, flags):
                task = self.running.get(rid)
                if flag and task is not None and not task.done():
                    task.cancel()

    async def _reclaim(self) -> None:
        while True:
            await asyncio.sleep(RECLAIM_EVERY_S)
            try:
                await self._reclaim_once()
            except Exception:
                log.warning("reclaiming background jobs failed", exc_info=True)

    async def _reclaim_once(self) -> None:
        """Claim the pending jobs of consumers whose liveness key lapsed (``fail_orphan`` then ``run_job``)."""
        client = redis()
        consumers: Any = await client.xinfo_consumers(jobs_key(), GROUP)
        for consumer in consumers:
            name = consumer["name"].decode() if isinstance(consumer["name"], bytes) else consumer["name"]
            if name == self.name or await client.exists(runner_key(name)):
                continue
            pending: Any = await client.xpending_range(jobs_key(), GROUP, min="-", max="+", count=100,
                                                       consumername=name)
            ids = [p["message_id"] for p in pending]
            if ids:
                claimed: Any = await client.xclaim(jobs_key(), GROUP, self.name, 0, ids)
                for entry_id, fields in claimed:
                    if fields:
                        self._spawn(entry_id, fields[b"id"].decode(), orphan=True)
            if len(ids) < 100:
                await client.xgroup_delconsumer(jobs_key(), GROUP, name)

