"""``manage.py serve``'s watch on its engine replicas' heartbeats.

A replica process that lives on while its heartbeat has lapsed serves nothing: the api processes stopped routing to
it when the heartbeat lapsed (``HEARTBEAT_TTL_S``), and ``serve`` restarts only processes that exited. The replica's
own watchdog (``inference/engine/watchdog.py``) ends a replica whose step loop hangs while its heartbeat thread runs;
this watch covers what that one cannot see: a process whose heartbeat thread cannot run either (native code that
spins holding the GIL, a process stopped with SIGSTOP and never continued) or has died. ``serve`` kills such a child
(``HeartbeatWatch.unresponsive``) and then restarts it as it restarts a dead one.

A replica is judged only after it was once seen beating (loading a model takes minutes, with no heartbeat), and only
on answered reads: a Redis outage (reads failing, or a gap between two answered reads longer than ``OUTAGE_S``)
starts every replica's clock again, since heartbeats could not be written meanwhile either. Replicas are named by
``(EngineStats.host, EngineStats.pid)``, so replicas of other hosts sharing the Redis never stand in for a local one.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable

import redis

from inference.protocol.engine import EngineStats, replica_key, replicas_index_key

ENGINE_UNRESPONSIVE_S = 60.0  # default of ``serve --engine-unresponsive-s``: 20 heartbeat TTLs
OUTAGE_S = 5.0  # two answered reads this far apart bracket a Redis outage (serve reads every second)


class HeartbeatWatch:
    """Which of ``serve``'s live engine processes stopped heart-beating ``unresponsive_s`` seconds ago or more.

    Args:
        client: the engine link's Redis.
        prefix: the link prefix (``settings.LINK_PREFIX``).
        models: served model names whose replicas ``serve`` runs.
        unresponsive_s: seconds without a seen heartbeat after which a once-beating process counts as unresponsive.
        host: this machine's host name as replicas report it (default ``socket.gethostname()``).
    """

    def __init__(self, client: redis.Redis, prefix: str, models: Iterable[str], unresponsive_s: float,
                 host: str | None = None):
        self.client = client
        self.prefix = prefix
        self.models = list(models)
        self.unresponsive_s = unresponsive_s
        self.host = host if host is not None else socket.gethostname()
        self._last_beat: dict[int, float] = {}  # pid -> monotonic time its heartbeat was last seen
        self._last_read: float | None = None  # monotonic time of the last answered read

    def beating_pids(self) -> set[int]:
        """Pids of this host's replicas with a live heartbeat now (one ZRANGEBYSCORE per model, one MGET). Raises
        ``redis.RedisError``."""
        now_ms = int(time.time() * 1000)
        pipe = self.client.pipeline(transaction=False)
        for m in self.models:
            pipe.zrangebyscore(replicas_index_key(self.prefix, m), now_ms, "+inf")
        keys = [replica_key(self.prefix, m, e.decode() if isinstance(e, bytes) else e)
                for m, ids in zip(self.models, pipe.execute()) for e in ids]
        stats = [EngineStats.from_wire(raw) for raw in (self.client.mget(keys) if keys else []) if raw]
        return {st.pid for st in stats if st.host == self.host}

    def unresponsive(self, pids: Iterable[int], now: float | None = None) -> list[int]:
        """Of ``pids`` (the engine processes that live now), those seen beating before whose heartbeat has not been
        seen for more than ``unresponsive_s`` seconds. ``now``: ``time.monotonic()`` unless given. A failed read
        returns ``[]`` (module docstring)."""
        now = time.monotonic() if now is None else now
        try:
            beating = self.beating_pids()
        except redis.RedisError:
            return []
        if self._last_read is not None and now - self._last_read > OUTAGE_S:
            self._last_beat = dict.fromkeys(self._last_beat, now)  # Redis was away: no heartbeat could be written
        self._last_read = now
        live = set(pids)
        self._last_beat = {pid: t for pid, t in self._last_beat.items() if pid in live}  # exited ones are forgotten
        for pid in beating & live:
            self._last_beat[pid] = now
        return [pid for pid, t in self._last_beat.items() if now - t > self.unresponsive_s]
