"""EngineCore: an engine replica's loop, joining its Redis link (``replica_link.ReplicaLink``) to its scheduler
(``base_scheduler.BaseScheduler``: the native ``scheduler.Scheduler``, ``pooling.PoolingScheduler`` or vLLM's
``vllm_backend.scheduler.VllmScheduler``) (docs/ARCHITECTURE.md §5, §6).

One iteration:

1. poll the link: the requests and aborts it read (blocking briefly only when the replica holds nothing);
2. hand them to the scheduler (``accept``, ``abort``), and abort the requests of api processes whose liveness lapsed;
   queue the outputs this made on the link and flush them (the acceptance outputs go out before a maybe long step,
   unless the scheduler's step is short: ``flush_before_step``);
3. one scheduler ``step``: each part of its outputs is queued and flushed as the step hands it out (the native
   scheduler hands a newcomer's first tokens out before its running batch's decode).

The link and the scheduler never import each other: what one returns, the core hands to the other. SIGTERM/SIGINT
stop the loop (``request_stop``); held requests then finish with ``error`` ("the engine shut down..."), and the
replica withdraws from the link (so another takes its unread requests). The heartbeat thread and the step-loop
watchdog are the link's (``ReplicaLink.start_heartbeat``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING

import redis

from inference.protocol.engine import EngineStats

from .replica_link import ReplicaLink

if TYPE_CHECKING:  # the schedulers load torch; the core does not (the command lines import it before their models)
    from .base_scheduler import BaseScheduler

log = logging.getLogger("inference.engine")

REDIS_RETRY_S = 0.5  # after a Redis error, the loop waits this long before its next iteration


def new_engine_id() -> str:
    """A random replica id (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def replica_stats(engine_id: str, model: str, device: str, max_num_seqs: int) -> EngineStats:
    """The heartbeat payload of a replica starting now in this process (its counters at 0)."""
    return EngineStats(engine_id=engine_id, model=model, pid=os.getpid(), host=socket.gethostname(), device=device,
                       max_num_seqs=max_num_seqs, started_at=time.time())


class EngineCore:
    """A replica of one served model: the loop between its link and its scheduler (module docstring).

    Args:
        link: the replica's ``ReplicaLink`` (not set up yet: ``run`` does it).
        scheduler: the backend's scheduler, with the same ``engine_id``.
    """

    def __init__(self, link: ReplicaLink, scheduler: BaseScheduler):
        if link.engine_id != scheduler.engine_id:
            raise ValueError(f"the link's engine id {link.engine_id!r} is not the scheduler's "
                             f"{scheduler.engine_id!r}")
        self.link = link
        self.scheduler = scheduler
        self.stop_event = threading.Event()

    def request_stop(self, *_args: object) -> None:
        """Signal handler: ask the loop to stop after the current step."""
        self.stop_event.set()

    def run(self) -> None:
        """Run until ``request_stop`` (SIGTERM/SIGINT); then fail held requests, withdraw from the link and shut the
        scheduler down (also when the link's setup fails). Raises ``redis.RedisError`` from the setup."""
        try:
            self.link.setup()
            self.scheduler.start()
            self._serve()
        finally:
            self.scheduler.shutdown()
            log.info("engine %s stopped", self.link.engine_id)

    def _serve(self) -> None:
        link, sched = self.link, self.scheduler
        link.start_heartbeat(sched.current_stats)
        log.info("engine %s serving %s on %s (max_num_seqs=%d, max_model_len=%d)", link.engine_id, link.model,
                 sched.stats.device, sched.max_num_seqs, sched.max_model_len)
        try:
            while not self.stop_event.is_set():
                link.turned()
                try:
                    self._iterate()
                except redis.RedisError as exc:
                    log.warning("redis error: %s; retrying", exc)
                    self.stop_event.wait(REDIS_RETRY_S)
        finally:
            self.stop_event.set()
            link.stop_heartbeat()
            # an error, not an abort: the client did not ask for the end, and a cut answer must not read as a
            # whole one (the api turns an abort into finish_reason "stop"; an error into engine_error)
            link.emit(sched.fail_all("the engine shut down before the request finished"))
            try:
                link.flush()
                link.withdraw()
            except redis.RedisError as exc:
                log.warning("cleanup failed: %s", exc)

    def _iterate(self) -> None:
        """One iteration of the loop (module docstring). Raises ``redis.RedisError``: outputs queued on the link
        stay queued for the next flush."""
        link, sched = self.link, self.scheduler
        # from the shared stream, take at most what fits soon (2 × max_num_seqs held), leaving the rest to others
        polled = link.poll(room=2 * sched.max_num_seqs - sched.num_held, block=sched.num_held == 0)
        link.emit(sched.accept(polled.requests))
        if polled.aborts:
            link.emit(sched.abort(polled.aborts))
        self._drop_dead_clients()
        if sched.flush_before_step:
            link.flush()  # acceptance outputs go out before the (maybe long) step
        if sched.num_held:
            for part in sched.step():
                link.emit(part)
                link.flush()
        else:
            link.flush()
        if sched.waiting:
            sched.wait_if_blocked()

    def _drop_dead_clients(self) -> None:
        """Abort the requests of api processes that stopped refreshing their liveness key (killed or restarted),
        so their slots never stay occupied for an output stream nobody reads; their outputs are dropped."""
        dead = self.link.dead_clients(self.scheduler.client_ids)
        if not dead:
            return
        ids = self.scheduler.requests_of(dead)
        log.warning("aborting %d request(s) of vanished api process(es) %s", len(ids), sorted(dead))
        self.link.emit(self.scheduler.abort(ids))
        self.link.forget_clients(dead)


def install_signal_handlers(core: EngineCore) -> None:
    """Route SIGTERM and SIGINT to ``core.request_stop``."""
    signal.signal(signal.SIGTERM, core.request_stop)
    signal.signal(signal.SIGINT, core.request_stop)
