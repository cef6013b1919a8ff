"""Blocking Redis reads outlive their block time: the channel layer's BZPOPMIN and the engine link's XREAD.

redis-py 8's default ``socket_timeout`` (5 s) equals channels_redis' BZPOPMIN block time, so an idle channel
layer receive died with ``redis.exceptions.TimeoutError`` after 5 s (the usage WebSocket dropped every 5 s).
Real Redis (``REDIS_URL`` or the local one, db 4), the settings' own channel layer configuration.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
from channels_redis.core import RedisChannelLayer
from django.conf import settings

from inference.api import engine_client
from inference.shared.redis_timeouts import SOCKET_TIMEOUT_MARGIN_S, blocking_socket_timeout
from harness.redis_keys import delete_matching, delete_prefix

URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/4"


def test_blocking_socket_timeout_outlasts_the_block_time():
    assert blocking_socket_timeout(5) == 5 + SOCKET_TIMEOUT_MARGIN_S
    assert blocking_socket_timeout(0) > 0
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            blocking_socket_timeout(bad)


def _layer_from_settings(prefix: str) -> RedisChannelLayer:
    """The settings' channel layer, on the test Redis and under ``prefix``."""
    config = dict(settings.CHANNEL_LAYERS["default"]["CONFIG"])
    config["hosts"] = [{**(host if isinstance(host, dict) else {}), "address": URL} for host in config["hosts"]]
    config["prefix"] = prefix
    return RedisChannelLayer(**config)


def test_settings_channel_layer_waits_longer_than_its_bzpopmin():
    assert settings.CHANNEL_LAYER_BRPOP_TIMEOUT_S == RedisChannelLayer.brpop_timeout
    layer = _layer_from_settings("x")
    for host in layer.hosts:
        timeout = host.get("socket_timeout")
        assert timeout is not None and timeout > RedisChannelLayer.brpop_timeout, layer.hosts


def test_idle_channel_layer_receive_survives_past_the_block_time_then_delivers():
    """A receive with nothing to read for 1.5 × the BZPOPMIN block time neither raises nor loses the next message."""
    prefix = f"llmptest-{uuid.uuid4().hex[:10]}:asgi"

    async def scenario():
        layer = _layer_from_settings(prefix)
        channel = await layer.new_channel()
        receive = asyncio.ensure_future(layer.receive(channel))
        done, _ = await asyncio.wait({receive}, timeout=RedisChannelLayer.brpop_timeout * 1.5)
        if done:  # before the fix: redis.exceptions.TimeoutError("Timeout reading from ...") after 5 s
            raise AssertionError(f"receive ended while idle: {receive.exception()!r}")
        await layer.send(channel, {"type": "usage.updated"})
        message = await asyncio.wait_for(receive, 20)
        await layer.flush()
        return message

    try:
        assert asyncio.run(scenario()) == {"type": "usage.updated"}
    finally:
        delete_matching(URL, f"{prefix}*")  # channels_redis keys: the prefix, no colon


def test_engine_link_xread_outlives_its_block_and_reads_what_arrives_after():
    """The engine link's pool waits longer than the reader's XREAD BLOCK; an idle read returns nil, not an error,
    and an output written after several idle reads is delivered."""
    prefix = f"llmptest-{uuid.uuid4().hex[:10]}"

    async def scenario():
        link = engine_client.EngineLink.for_current_process(URL, prefix)
        try:
            timeout = link.redis.connection_pool.connection_kwargs.get("socket_timeout")
            assert timeout is None or timeout > engine_client.READ_BLOCK_MS / 1000
            key = f"{prefix}:idle-probe"
            assert await link.redis.xread({key: "0-0"}, block=engine_client.READ_BLOCK_MS) in ([], {}, None)
            await link.redis.xadd(key, {"o": b"x"})
            got = await link.redis.xread({key: "0-0"}, block=engine_client.READ_BLOCK_MS)
            assert got, got
        finally:
            await link.close()
            engine_client.EngineLink._instances.clear()

    try:
        asyncio.run(scenario())
    finally:
        delete_prefix(URL, prefix)
