"""Socket timeouts for Redis clients that issue blocking commands (``BZPOPMIN``, ``XREAD BLOCK``, ...).

redis-py applies its ``socket_timeout`` to every reply, a blocking command's included: a client whose socket
timeout is not longer than the block time raises ``redis.exceptions.TimeoutError`` ("Timeout reading from
HOST:PORT") whenever the command waits its whole block time, i.e. whenever nothing arrives. redis-py 8 made
that default 5 s (``redis._defaults.DEFAULT_SOCKET_TIMEOUT``; redis-py 5 to 7 had none), exactly the block
time of channels_redis' ``BZPOPMIN`` (``RedisChannelLayer.brpop_timeout``), so every idle WebSocket consumer
died after 5 s. Every client the platform creates for blocking commands therefore states its socket timeout
with ``blocking_socket_timeout`` instead of inheriting the library's default.
"""

from __future__ import annotations

import math

# Slack (s) between the longest block time of a client's commands and its socket timeout: Redis answers a
# blocking command within milliseconds of its block time, plus whatever a loaded server or event loop adds.
SOCKET_TIMEOUT_MARGIN_S = 10.0


def blocking_socket_timeout(block_s: float) -> float:
    """Socket timeout in seconds for a Redis client whose longest blocking command waits ``block_s`` seconds
    (``BZPOPMIN key block_s``, ``XREAD BLOCK block_s*1000``): ``block_s + SOCKET_TIMEOUT_MARGIN_S``, so a
    command that times out on the server always answers (nil) before the client gives up on the socket, and a
    dead server or half-open connection is still noticed.

    Raises ``ValueError`` for a negative, infinite or NaN ``block_s`` (a command that blocks forever, e.g.
    ``BLPOP key 0``, needs ``socket_timeout=None`` instead).
    """
    if not math.isfinite(block_s) or block_s < 0:
        raise ValueError(f"block time must be a finite number of seconds >= 0, got {block_s!r}")
    return block_s + SOCKET_TIMEOUT_MARGIN_S
