"""A request whose send failed after its entry reached the engine's stream is aborted, not run to ``max_tokens``
for nobody. The api's engine link stops tracking a request whose send raised, so the handler's own abort at its end
skipped it; the send raises after the entry landed when the handler is cancelled while Redis's reply is on its way
(a client that hung up at that moment: the fresh-eyes check of 2026-12-02 saw 2-4 such generations of 120 early
disconnects keep running under load, holding batch slots admission had already released), on a timeout, or when a
later command of the same pipeline fails. The last is what this test does, deterministically: the model's routing
counts are made a string, so the pipeline's HINCRBY fails right after its XADD. The api's own engine link, a real
engine, real Redis."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis

from inference.api.engine_client import ROUTING_PREFIX, EngineLink
from inference.protocol.engine import FINISH_ABORT, EngineCoreRequest, SamplingParams, api_alive_key, routing_key
from tests.engine.conftest import EOS_IDS, MODEL


def test_request_whose_send_failed_after_it_landed_is_aborted(engine, redis_url):
    rid = f"cs-{uuid.uuid4().hex[:8]}"
    sp = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, eos_token_ids=EOS_IDS)
    # its outputs go to the test's own client stream (the link drops outputs of a request it does not track)
    req = EngineCoreRequest(request_id=rid, external_req_id=rid, prompt_token_ids=[1500, 1501, 1502],
                            sampling_params=sp, client_id=engine.client_id, arrival_time=time.time())
    engine.r.set(api_alive_key(engine.prefix, engine.client_id), b"1", ex=120)
    routing = routing_key(engine.prefix, MODEL)
    engine.r.delete(routing)
    engine.r.set(routing, b"not a hash")

    async def send() -> None:
        link = EngineLink.for_current_process(redis_url, engine.prefix)
        link.routing = ROUTING_PREFIX
        try:
            with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
                await link.add_requests(MODEL, [req])
            assert link.num_tracked == 0
            await asyncio.sleep(0.5)  # the abort goes out from a task of its own
        finally:
            await link.close()

    try:
        asyncio.run(send())
    finally:
        engine.r.delete(routing)
    outs = engine.collect([rid], timeout=120)[rid]
    assert outs[-1].finish_reason == FINISH_ABORT, outs[-1]
    assert sum(len(o.new_token_ids) for o in outs) < 400


def test_abort_of_a_released_request_still_reaches_the_engine(engine, redis_url):
    """A stop string's abort runs on a task of its own and may come after the handler released the request (no
    longer tracked): it must still stop the engine's work."""
    rid = f"rel-{uuid.uuid4().hex[:8]}"
    sp = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, eos_token_ids=EOS_IDS)
    req = EngineCoreRequest(request_id=rid, external_req_id=rid, prompt_token_ids=[1600, 1601, 1602],
                            sampling_params=sp, client_id=engine.client_id, arrival_time=time.time())
    engine.r.set(api_alive_key(engine.prefix, engine.client_id), b"1", ex=120)

    async def scenario() -> None:
        link = EngineLink.for_current_process(redis_url, engine.prefix)
        try:
            await link.add_requests(MODEL, [req])
            link.release(rid)
            await link.abort(MODEL, [rid])
        finally:
            await link.close()

    asyncio.run(scenario())
    outs = engine.collect([rid], timeout=120)[rid]
    assert outs[-1].finish_reason == FINISH_ABORT, outs[-1]
