"""``POST /inference/v1/abort_requests`` goes through the engine link (``EngineLink.abort_in_engines``), whose map
of re-sent ids it needs: the generate request may run in another api process, which may have re-sent it to a live
replica under a new id (``EngineLink._resend``), so the abort names those ids too; a request this process tracks is
aborted under the id its replica has and stays tracked (its own handler reads the replica's ``abort`` output and
ends its stream). Real consumer over ASGI, a real API key in the database, real Redis, the process's real engine
link; a replica's heartbeat written on the link stands in for an engine (no model runs here)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import msgpack
import pytest
import redis.asyncio as aioredis
from asgiref.testing import ApplicationCommunicator

from gateway.endpoints.generate import AbortRequestsConsumer, GenerateConsumer
from gateway import clients
from inference.api.engine_client import MAX_RESENDS, EngineLink
from inference.protocol.engine import (
    EngineCoreRequest,
    EngineStats,
    SamplingParams,
    control_stream,
    replica_key,
    replicas_index_key,
)
from tenancy.services import api_key_create, tenant_get_or_create
from tests.support.redis import TEST_REDIS_URL, fresh_prefix

MODEL = "abort-m"


@pytest.fixture
def platform(settings, transactional_db, db_connections_closed_in_their_threads):
    with fresh_prefix("aborttest") as prefix:
        settings.REDIS_URL, settings.LINK_PREFIX = TEST_REDIS_URL, prefix
        clients._pools.clear()
        tenant = tenant_get_or_create(name="abort-tenant")
        yield prefix, tenant, api_key_create(tenant=tenant, name="k")[1]


async def _abort(key: str, ids: list[str]) -> int:
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": "/inference/v1/abort_requests",
             "raw_path": b"/inference/v1/abort_requests", "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    comm = ApplicationCommunicator(AbortRequestsConsumer.as_asgi(), scope)
    await comm.send_input({"type": "http.request", "body": json.dumps({"request_ids": ids}).encode(),
                           "more_body": False})
    start = await comm.receive_output(timeout=30)
    while (await comm.receive_output(timeout=30)).get("more_body"):
        pass
    await comm.send_input({"type": "http.disconnect"})
    await comm.wait(timeout=10)
    return int(start["status"])


async def _aborted(prefix: str) -> list[list[str]]:
    r = aioredis.Redis.from_url(TEST_REDIS_URL)
    try:
        return [msgpack.unpackb(fields[b"a"]) for _id, fields in await r.xrange(control_stream(prefix, MODEL))]
    finally:
        await r.aclose()


async def _map(prefix: str, tenant_id: int, external_id: str, internal: list[str]) -> None:
    """What the generate route records for a request (``GenerateConsumer._map_for_abort``), under the tenant."""
    key = f"{prefix}:gen:{tenant_id}:{external_id}"
    await GenerateConsumer._map_for_abort(key, None, [msgpack.packb([MODEL, rid]) for rid in internal])


async def test_an_abort_from_another_process_names_the_resent_ids_too(platform):
    prefix, tenant, key = platform
    internal = f"gen-x-{uuid.uuid4().hex[:8]}"
    await _map(prefix, tenant.id, "gen-x", [internal])  # a request another api process runs
    assert await _abort(key, ["gen-x", "unknown-id"]) == 200
    assert await _aborted(prefix) == [[internal, *(f"{internal}~r{n}" for n in range(1, MAX_RESENDS + 1))]]


async def test_a_request_this_process_tracks_is_aborted_under_its_engine_id_and_stays_tracked(platform):
    prefix, tenant, key = platform
    r = aioredis.Redis.from_url(TEST_REDIS_URL)
    stats = EngineStats(engine_id="e1", model=MODEL, pid=1, device="cpu", max_num_seqs=4)
    await r.set(replica_key(prefix, MODEL, "e1"), stats.to_wire(), ex=30)
    await r.zadd(replicas_index_key(prefix, MODEL), {"e1": int(time.time() * 1000) + 30_000})
    await r.aclose()
    link = clients.link()
    rid = f"gen-y-{uuid.uuid4().hex[:8]}"
    queue: asyncio.Queue = asyncio.Queue()
    await link.add_requests(MODEL, [EngineCoreRequest(rid, "gen-y", [1, 2, 3], SamplingParams(), link.client_id,
                                                      time.time())], queue)
    await _map(prefix, tenant.id, "gen-y", [rid])
    tracked = link.num_tracked
    assert await _abort(key, ["gen-y"]) == 200
    assert await _aborted(prefix) == [[rid]]
    assert link.num_tracked == tracked  # the replica's abort output still reaches the request's handler
    link.release(rid)
    await EngineLink.close(link)
    EngineLink._instances.clear()
