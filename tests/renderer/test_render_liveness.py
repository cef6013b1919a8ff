"""inference.api.render_liveness: the render workers' beats on the real Redis, and how long a render may still wait."""

from __future__ import annotations

import asyncio
import math

import pytest
import redis
import redis.asyncio as aioredis

from inference.api.render_liveness import (NO_WORKER_SEEN, STALE_AFTER_S, RenderWorkersState, beat, liveness_key,
                                       remaining_wait, workers_state)
from tests.support.redis import TEST_REDIS_URL, fresh_prefix


def test_wait_policy():
    up = RenderWorkersState(seen_ago_s=0.2, up_for_s=3600)  # alive all along
    # alive all along: the fixed timeout
    assert remaining_wait(20, up, 20, 40) == 0
    assert remaining_wait(5, up, 20, 40) == 15
    # a worker back 4 s ago: the whole timeout from its return
    assert remaining_wait(20, RenderWorkersState(seen_ago_s=0.5, up_for_s=4), 20, 40) == 16
    # alive by its last beat, but that beat is late (it may have just died): look again once it would be stale
    assert remaining_wait(20, RenderWorkersState(seen_ago_s=2.0, up_for_s=3600), 20, 40) == pytest.approx(
        STALE_AFTER_S - 2.0 + 0.1)
    # none alive (or never seen): wait for one to come back, from the send
    down = RenderWorkersState(seen_ago_s=12, up_for_s=0)
    assert remaining_wait(20, down, 20, 40) == 20
    assert remaining_wait(20, NO_WORKER_SEEN, 20, 40) == 20
    assert remaining_wait(40, down, 20, 40) == 0
    # never past timeout + worker_return in all, however the workers flap
    assert remaining_wait(55, RenderWorkersState(seen_ago_s=0.1, up_for_s=1), 20, 40) == 5
    # worker_return 0: a fixed timeout, whatever the beats say
    assert remaining_wait(20, down, 20, 0) == 0


def test_beats_on_redis():
    client = redis.Redis.from_url(TEST_REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {TEST_REDIS_URL}: {exc}")

    async def state(prefix: str) -> RenderWorkersState:
        aclient = aioredis.Redis.from_url(TEST_REDIS_URL)
        try:
            return await workers_state(aclient, prefix)
        finally:
            await aclient.aclose()

    with fresh_prefix("liveness") as prefix:
        assert asyncio.run(state(prefix)) == NO_WORKER_SEEN and not NO_WORKER_SEEN.alive
        beat(client, prefix)
        first = asyncio.run(state(prefix))
        assert first.alive and first.seen_ago_s < 1 and first.up_for_s < 1
        key = liveness_key(prefix)
        seen = float(client.hget(key, "seen"))
        client.hset(key, mapping={"since": f"{seen - 100:.3f}"})  # beating for 100 s
        beat(client, prefix)
        assert asyncio.run(state(prefix)).up_for_s == pytest.approx(100, abs=1)  # the same run of beats goes on
        client.hset(key, mapping={"seen": f"{seen - 10:.3f}"})  # the last beat 10 s ago
        gone = asyncio.run(state(prefix))
        assert not gone.alive and gone.seen_ago_s == pytest.approx(10, abs=1) and gone.up_for_s == 0
        beat(client, prefix)  # a worker is back: a new run of beats begins
        back = asyncio.run(state(prefix))
        assert back.alive and back.up_for_s < 1
        assert 0 < client.ttl(key) <= 86400
    assert not math.isinf(first.up_for_s)
    client.close()


def test_a_render_nobody_answers_is_refused_by_the_beats():
    """RenderReplyWaiter.call on a queue no worker consumes: with a render worker beating, sent again once after the
    timeout and refused half a timeout later; with none, refused only after worker_return; with worker_return 0,
    after the timeout whatever the beats."""
    from celery import Celery

    from inference.api.render_client import RenderReplyWaiter, RenderUnavailableError

    client = redis.Redis.from_url(TEST_REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {TEST_REDIS_URL}: {exc}")

    with fresh_prefix("liveness") as prefix:
        sender = Celery("liveness-test", broker=TEST_REDIS_URL)
        sender.conf.update(broker_transport_options={"global_keyprefix": f"{prefix}:celery:"})

        async def refused_after(timeout: float, worker_return: float, beating: bool) -> float:
            waiter = RenderReplyWaiter(TEST_REDIS_URL, prefix)
            loop = asyncio.get_running_loop()
            if beating:
                beat(client, prefix)
                key = liveness_key(prefix)
                client.hset(key, mapping={"since": f"{float(client.hget(key, 'since')) - 100:.3f}"})
            async def beating_on() -> None:
                while beating:
                    await asyncio.to_thread(beat, client, prefix)
                    await asyncio.sleep(0.3)

            beats = asyncio.create_task(beating_on())
            t0 = loop.time()
            with pytest.raises(RenderUnavailableError):
                await waiter.call(sender, "inference.render_chat", {"messages": []}, queue="nobody",
                                  timeout=timeout, worker_return=worker_return)
            beats.cancel()
            return loop.time() - t0

        # alive for 100 s: the timeout, the render sent again once, half the timeout more (D-194)
        assert 0.6 <= asyncio.run(refused_after(0.4, 1.2, beating=True)) < 1.2
        assert client.llen(f"{prefix}:celery:nobody") == 2  # sent twice
        client.delete(liveness_key(prefix), f"{prefix}:celery:nobody")
        assert 1.2 <= asyncio.run(refused_after(0.4, 1.2, beating=False)) < 2.5  # none alive: worker_return
        assert 0.4 <= asyncio.run(refused_after(0.4, 0, beating=False)) < 1.0  # off: the fixed timeout
    client.close()
