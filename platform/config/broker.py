"""Celery's Redis broker transport with one reused Redis client per channel.

kombu's Redis channel builds a new ``redis.Redis`` client object for every publish (``conn_or_acquire``
without a client), and with redis-py 8 that constructor is expensive: it copies the response-callback
table and, now and then, reads the package metadata for the client's driver info. Measured in the api
process on the 2-core box: about 2 ms of CPU per ``send_task`` out of the ~11 ms a text chat request costs
there, all of it holding the GIL that the event loop needs. This transport keeps the first client it
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
