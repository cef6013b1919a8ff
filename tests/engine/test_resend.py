"""Requests waiting on a replica that dies are sent again to a live one (``EngineLink._resend``): the api's own
engine link and two real engine processes over the real Redis link. The requests that had started fail with the
engine error as before; the ones that had produced nothing finish on the other replica, under the ids their caller
knows."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest

from gateway.endpoints.metrics import _replica_families
from inference.api.engine_client import ROUTING_PREFIX, EngineLink
from inference.protocol.engine import FINISH_ERROR, FINISH_LENGTH, EngineCoreOutput, EngineCoreRequest, SamplingParams
from tests.engine.conftest import EOS_IDS, MODEL, EngineProc

MAX_TOKENS = 200


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _request(i: int) -> EngineCoreRequest:
    rid = f"resend-{i}-{uuid.uuid4().hex[:8]}"
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, eos_token_ids=EOS_IDS)
    return EngineCoreRequest(request_id=rid, external_req_id=rid, prompt_token_ids=[1000 + i, 2000 + i, 3000 + i],
                             sampling_params=sp, client_id="", arrival_time=time.time())


@pytest.mark.timeout(300)
def test_requests_waiting_on_a_dead_replica_finish_on_another(redis_url, link_prefix, model_dir, tmp_path):
    prefix = f"{link_prefix}rs"
    a = EngineProc(redis_url, prefix, model_dir, tmp_path / "a.log", "--max-num-seqs", "2", "--max-model-len", "512",
                   "--num-threads", "1")
    b = EngineProc(redis_url, prefix, model_dir, tmp_path / "b.log", "--max-model-len", "512", "--num-threads", "1")
    try:
        # b out of the choice (its heartbeat lapses): every request is routed to a, which runs 2 and holds 2 waiting
        os.kill(b.proc.pid, signal.SIGSTOP)
        _wait(lambda: not a.r.exists(b.hb_key), 15, "b's heartbeat to lapse")

        async def scenario() -> tuple[dict[str, list[EngineCoreOutput]], EngineLink]:
            link = EngineLink.for_current_process(redis_url, prefix)
            link.routing = ROUTING_PREFIX
            got: dict[str, list[EngineCoreOutput]] = {}
            queues = {}
            for i in range(4):
                req = _request(i)
                req.client_id = link.client_id
                queues |= await link.add_requests(MODEL, [req])
                got[req.request_id] = []

            async def drain(rid: str, q: asyncio.Queue) -> None:
                while True:
                    out = await q.get()
                    got[rid].append(out)
                    if out.finish_reason is not None:
                        return

            tasks = [asyncio.create_task(drain(rid, q)) for rid, q in queues.items()]
            deadline = time.monotonic() + 120
            while not (all(any(o.engine_id == a.engine_id for o in outs) for outs in got.values())
                       and sum(any(o.new_token_ids for o in outs) for outs in got.values()) == 2):
                assert time.monotonic() < deadline, got
                await asyncio.sleep(0.02)
            # a frozen with 2 running and 2 waiting; b back; a's heartbeat lapses, then a is killed
            os.kill(a.proc.pid, signal.SIGSTOP)
            os.kill(b.proc.pid, signal.SIGCONT)
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            os.kill(a.proc.pid, signal.SIGKILL)
            return got, link

        async def run() -> dict[str, list[EngineCoreOutput]]:
            got, link = await scenario()
            assert link.num_tracked == 0 and not link._resent
            # the two re-sends are counted, as /metrics exports them
            families = {f.name: f for f in await _replica_families(link.redis, prefix, [MODEL])}
            assert [(s.labels, s.value) for s in families["engine_resent_requests"].samples
                    if s.name.endswith("_total")] == [({"model": MODEL}, 2)]
            await link.close()
            return got

        got = asyncio.run(run())
        started = {rid for rid, outs in got.items() if any(o.new_token_ids and o.engine_id == a.engine_id
                                                           for o in outs)}
        assert len(started) == 2
        for rid, outs in got.items():
            assert all(o.request_id == rid for o in outs)  # the caller's ids, also for what b sent
            fin = outs[-1]
            if rid in started:
                assert fin.finish_reason == FINISH_ERROR and "stopped responding" in (fin.error or ""), fin
            else:
                assert fin.finish_reason == FINISH_LENGTH, fin
                assert sum(len(o.new_token_ids) for o in outs) == MAX_TOKENS
                assert {o.engine_id for o in outs if o.new_token_ids} == {b.engine_id}
    finally:
        for eng in (a, b):
            try:
                os.kill(eng.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            eng.stop(timeout=10)
