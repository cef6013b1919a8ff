"""Whether a render worker is alive, for how long the gateway waits on a render (issue 18, DECISIONS D-191).

Every Celery worker that consumes the ``render`` queue beats once a second (``beat``, from a consumer bootstep in
``platform/config/celery.py``) into one Redis hash per link prefix, ``{prefix}:render:alive``: ``seen``, the last
beat of any render worker, and ``since``, when the current run of beats began (a gap over ``STALE_AFTER_S`` starts
a new run). Both are Redis server time (``TIME``), so api and worker clocks never meet.

The api reads it (``workers_state``) only when a render has waited its whole ``RENDER_WAIT_TIMEOUT_S``, and
``remaining_wait`` decides whether to wait on: a request is refused when a render worker has been alive for the
whole timeout of its wait (counted from the send, or from a worker's return), or when none has been alive for
``RENDER_WORKER_RETURN_S`` since the send; never after ``timeout + worker_return`` in all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

HEARTBEAT_INTERVAL_S = 1.0  # a render worker beats this often
LATE_AFTER_S = 1.5  # no beat for this long: the beats are late (the workers may have just died)
STALE_AFTER_S = 3.0  # no beat for this long: no render worker is alive (three missed beats)

_BEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local seen = tonumber(redis.call('HGET', KEYS[1], 'seen') or '0')
if now - seen > tonumber(ARGV[1]) then redis.call('HSET', KEYS[1], 'since', string.format('%.3f', now)) end
redis.call('HSET', KEYS[1], 'seen', string.format('%.3f', now))
redis.call('EXPIRE', KEYS[1], 86400)
return 1
"""

_STATE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local v = redis.call('HMGET', KEYS[1], 'seen', 'since')
if not v[1] then return {} end
return {string.format('%.3f', now - tonumber(v[1])), string.format('%.3f', now - tonumber(v[2] or v[1]))}
"""


def liveness_key(prefix: str) -> str:
    """The Redis hash of the render workers' beats under link prefix ``prefix``."""
    return f"{prefix}:render:alive"


@dataclass(frozen=True)
class RenderWorkersState:
    """What the beats say now: ``seen_ago_s``, seconds since the last beat of any render worker (infinite when none
    ever beat under this prefix); ``up_for_s``, seconds since the current run of beats began (0 when none is alive).
    """

    seen_ago_s: float
    up_for_s: float

    @property
    def alive(self) -> bool:
        """A render worker beat within ``STALE_AFTER_S``."""
        return self.seen_ago_s <= STALE_AFTER_S


NO_WORKER_SEEN = RenderWorkersState(seen_ago_s=math.inf, up_for_s=0.0)


def beat(client: redis.Redis, prefix: str) -> None:
    """One render worker's beat (one Lua call). Raises ``redis.RedisError`` when Redis is unreachable."""
    client.eval(_BEAT, 1, liveness_key(prefix), STALE_AFTER_S)


def state_from_reply(reply: list[bytes | str] | None) -> RenderWorkersState:
    """The ``RenderWorkersState`` of the state script's reply (``[since last beat, since the run began]`` in
    seconds, or empty when nothing ever beat)."""
    if not reply:
        return NO_WORKER_SEEN
    since_seen, since_start = (max(0.0, float(x)) for x in reply)
    return RenderWorkersState(seen_ago_s=since_seen, up_for_s=since_start if since_seen <= STALE_AFTER_S else 0.0)


async def workers_state(client: aioredis.Redis, prefix: str) -> RenderWorkersState:
    """The render workers' state now (one Lua call on Redis's clock). Raises ``redis.RedisError``."""
    reply = await client.eval(_STATE, 1, liveness_key(prefix))
    return state_from_reply(reply)


def remaining_wait(waited_s: float, state: RenderWorkersState, timeout_s: float, worker_return_s: float) -> float:
    """Seconds a render that has waited ``waited_s`` may still wait (0 or less: refuse it now).

    * a render worker is alive: ``timeout_s`` counted from the later of the send and the start of the current run
      of beats (a worker that just came back gets the whole timeout to serve what waited for it); when that has
      passed but the last beat is late (over ``LATE_AFTER_S`` ago: the worker may have just died), until the beats
      would be stale, to look again;
    * none is: ``worker_return_s`` counted from the send (how long a request waits for one to come back);
    * never more than ``timeout_s + worker_return_s`` from the send; ``worker_return_s`` 0 turns all of this off
      (a fixed ``timeout_s``).
    """
    cap = timeout_s + worker_return_s - waited_s
    if worker_return_s <= 0:
        return timeout_s - waited_s
    if state.alive:
        left = timeout_s - min(waited_s, state.up_for_s)
        if left <= 0 and state.seen_ago_s > LATE_AFTER_S:
            left = STALE_AFTER_S - state.seen_ago_s + 0.1
        return min(cap, left)
    return min(cap, worker_return_s - waited_s)
