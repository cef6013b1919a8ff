"""A caller cancelled while its reservation script runs in Redis leaks nothing (``inference.api.cancel_safe``).

The client that disconnects just as its admission pre-check (or its key-limit acquire) is in flight is the
case: Redis has run the script, the handler is cancelled before it reads the reply, and without care no one
holds the reservation's handle. A loopback proxy in front of the real Redis holds Redis's replies back, so the
test cancels the caller exactly in that window: after the script ran (seen on a direct connection), before the
reply arrived (the pooled connection is made and the script loaded first, so the call is one round trip)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis.asyncio as aioredis

from inference.api.admission import Admission
from gateway import clients
from gateway.pipeline import limits
from tenancy.limits import Limits, limits_usage
from tenancy.selectors import AuthContext
from tests.support.fake_engine import FakeConsumer
from tests.support.redis import TEST_REDIS_URL, fresh_prefix

MODEL = "cancel-m"


class ReplyGate:
    """A TCP proxy on 127.0.0.1 to the test Redis that forwards requests at once and replies only while
    ``open`` is set."""

    def __init__(self, target_url: str):
        parts = urlsplit(target_url)
        self._target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self._parts = parts
        self.open = asyncio.Event()
        self.open.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> ReplyGate:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._server is not None
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        netloc = self._parts.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{port}"
        return urlunsplit(self._parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)

        async def pump(src, dst, gated: bool):
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    if gated:
                        await self.open.wait()
                    dst.write(data)
                    await dst.drain()
            dst.close()

        for t in (asyncio.ensure_future(pump(reader, up_writer, False)),
                  asyncio.ensure_future(pump(up_reader, writer, True))):
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)


async def _until(pred, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await pred()
        if value:
            return value
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def _cancel_in_flight(task: asyncio.Task, taken) -> None:
    """Wait until Redis shows what ``task`` took (replies still held back), then cancel ``task``."""
    await _until(taken)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_precheck_cancelled_after_the_script_ran_is_released():
    with fresh_prefix("cancel") as prefix:
        direct = aioredis.Redis.from_url(TEST_REDIS_URL)
        async with ReplyGate(TEST_REDIS_URL) as gate:
            a = Admission(redis=aioredis.Redis.from_url(gate.url), prefix=prefix)

            async def counters():
                s = await Admission(redis=direct, prefix=prefix).snapshot(MODEL)
                return s["queued_reqs"], s["queued_tokens"]

            await a.release(await a.precheck(MODEL, "warm", 1, 1))  # connection made, script loaded
            gate.open.clear()
            task = asyncio.ensure_future(a.precheck(MODEL, "req-1", 2, 30))
            await _cancel_in_flight(task, lambda: _is(counters, (2, 60)))
            gate.open.set()  # the reply arrives after the caller is gone
            await _until(lambda: _is(counters, (0, 0)))
            # and a precheck that is not cancelled still holds until released
            res = await a.precheck(MODEL, "req-2", 1, 5)
            assert await counters() == (1, 5)
            await a.release(res)
            assert await counters() == (0, 0)
            await a.redis.aclose()
        await direct.aclose()


async def _is(fn, expected):
    return await fn() == expected


async def test_key_limit_acquire_cancelled_after_the_script_ran_frees_the_slot(settings):
    ctx = AuthContext(key_id=int(time.time() * 1000) % 10**9, key_prefix="k", tenant_id=8, tenant_name="t",
                      allowed_models=(), scopes=("inference",), expires_at=None,
                      key_limits=Limits(max_concurrent=1))
    with fresh_prefix("cancellim") as prefix:
        direct = aioredis.Redis.from_url(TEST_REDIS_URL)
        async with ReplyGate(TEST_REDIS_URL) as gate:
            settings.REDIS_URL, settings.LINK_PREFIX = gate.url, prefix
            clients._pools.clear()

            async def concurrent():
                return (await limits_usage(direct, prefix, ctx))["key"]["concurrent"]

            await limits.settle(await limits.acquire(FakeConsumer(), ctx, 10), 0)  # connection made, script loaded
            gate.open.clear()
            task = asyncio.ensure_future(limits.acquire(FakeConsumer(), ctx, 10))
            await _cancel_in_flight(task, lambda: _is(concurrent, 1))
            gate.open.set()
            await _until(lambda: _is(concurrent, 0))
            grant = await limits.acquire(FakeConsumer(), ctx, 10)  # the one slot is free again
            assert await concurrent() == 1
            await limits.settle(grant, 0)
            assert await concurrent() == 0
            clients._pools.clear()
        await direct.aclose()
