"""Celery's Redis broker transport with one reused Redis client per channel.

kombu's Redis channel builds a new ``redis.Redis`` client object for every publish (``conn_or_acquire``
without a client), and with redis-py 8 that constructor is expensive: it copies the response-callback
table and, now and then, reads the package metadata for the client's driver info. Measured on the 2-core
box, ``send_task`` in a warm loop: 1.62 ms of CPU with kombu's transport, 1.21 ms with this one, 0.65 ms with
``argsrepr``/``kwargsrepr`` given as well (the api does); in the api process that work holds the GIL the event
loop needs, and a text chat request costs the api ~10 ms of CPU in all. This transport keeps the first client it
builds and hands it out again; ``redis.Redis`` is thread-safe (every command checks a connection out of
the channel's pool), so the reuse changes nothing else.

Selected by ``CELERY_BROKER_TRANSPORT = "config.broker:Transport"`` (``config.settings``); the broker URL
stays ``redis://...``. (A library fix belongs in kombu; this subclass is the smallest local override.)
"""

from __future__ import annotations

from contextlib import contextmanager

from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    """kombu's Redis channel whose ``conn_or_acquire()`` reuses one synchronous client."""

    _reused_client = None

    @contextmanager
    def conn_or_acquire(self, client=None):
        """Yield ``client`` when given, else this channel's reused client (created on first use)."""
        if client:
            yield client
            return
        if self._reused_client is None:
            self._reused_client = self._create_client()
        yield self._reused_client


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with ``Channel`` above."""

    Channel = Channel
