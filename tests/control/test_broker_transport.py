"""config.broker: kombu's Redis transport with one reused client per channel, on the real Redis."""

from __future__ import annotations

import uuid

from kombu import Connection

from config.broker import Transport


def test_settings_select_the_reusing_transport_for_redis_urls(settings):
    assert settings.CELERY_BROKER_URL.startswith("redis://")
    assert settings.CELERY_BROKER_TRANSPORT == "config.broker:Transport"
    from config.celery import app

    with app.connection_for_write() as conn:
        assert conn.transport_cls == "config.broker:Transport"
        assert isinstance(conn.transport, Transport)


def test_one_client_serves_every_publish_and_messages_arrive(redis_url, redis_client, link_prefix):
    with Connection(redis_url, transport="config.broker:Transport",
                    transport_options={"global_keyprefix": f"{link_prefix}:celery:"}) as conn:
        channel = conn.channel()
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second
        given = object()
        with channel.conn_or_acquire(given) as passed:
            assert passed is given  # an explicit client is still used as given

        queue = conn.SimpleQueue(f"broker-test-{uuid.uuid4().hex[:8]}")
        try:
            for i in range(5):
                queue.put({"i": i})
            got = []
            for _ in range(5):
                msg = queue.get(timeout=5)
                got.append(msg.payload["i"])
                msg.ack()
            assert got == [0, 1, 2, 3, 4]
            assert redis_client.llen(f"{link_prefix}:celery:{queue.queue.name}") == 0
        finally:
            queue.close()
