"""What every engine scheduler shares, and the contract the core loop (``core.EngineCore``) drives.

A scheduler holds the requests a replica accepted and turns them into outputs; it does no I/O of the link
(``replica_link.py``), and each of its calls returns the outputs it made, per api process (``Outputs``: ``client_id``
-> ``EngineCoreOutput``s in order), for the core to hand to the link:

* ``accept(requests)``: every newly read request is answered at once with an empty output (``queued_ts``,
  ``engine_id``), so the api process knows which replica owns it; an invalid one fails here with ``error``. Valid ones
  wait in order of ``priority`` (the caller's tier, set by the gateway from the API key:
  ``inference.api.admission.engine_priority``), then arrival (``enqueue_by_priority``: vLLM's priority scheduling order,
  without its preemption).
* ``abort(ids)``: held requests end with ``abort``; an abort may overtake its request (still unread in the request
  stream), so the ids of requests not held are remembered for ``EARLY_ABORT_S`` and applied when they arrive.
* ``step()``: one engine iteration. It yields its outputs in parts, in the order they are to be published: the core
  publishes each part before asking for the next, so a scheduler whose step runs two forwards (the native one:
  prefills, then the running batch's decode) hands the first tokens out between them. Parts rather than a callback
  the core passes in: the outputs stay return values (the scheduler holds nothing of the core or the link, not even
  a function), and a test reads a step's parts with ``list(step())``. The caller must exhaust the iterator.
* ``fail_all(message)``: every held request ends with ``error`` (the replica shuts down).

The backends' schedulers (``scheduler.Scheduler``, ``pooling.PoolingScheduler``,
``vllm_backend.scheduler.VllmScheduler``) subclass ``BaseScheduler`` and say how a request is validated
(``_prepare``), what they hold past the waiting queue (``active``), how that is aborted and how a step runs.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TypedDict

from inference.protocol.engine import FINISH_ABORT, FINISH_ERROR, EngineCoreOutput, EngineCoreRequest, EngineStats

from .runner import RequestError, make_rng, now
from .sequence import Sequence

log = logging.getLogger("inference.engine")

EMA_ALPHA = 0.3
EARLY_ABORT_S = 60.0  # how long an abort for a not-yet-read request is remembered
EARLY_ABORTS_MAX = 10000  # remembered early aborts past which the expired ones are dropped at once

Outputs = dict[str, list[EngineCoreOutput]]
"""Outputs per api process: ``client_id`` -> its ``EngineCoreOutput``s, in the order made."""


class _OutputBase(TypedDict):
    """The fields every output of a just-accepted request carries."""

    request_id: str
    queued_ts: float
    engine_id: str


def ema(old: float, new: float) -> float:
    """The exponential moving average (weight ``EMA_ALPHA``) of a rate after sample ``new``; ``new`` when ``old`` is
    0 (the first sample)."""
    return new if old == 0 else (1 - EMA_ALPHA) * old + EMA_ALPHA * new


def enqueue_by_priority(waiting: deque[Sequence], seq: Sequence) -> None:
    """Insert ``seq`` into ``waiting`` ordered by ``(request.priority, request.arrival_time)`` (vLLM's priority
    scheduling order: a lower value first), after any equal key, so requests of one priority (the children of one
    request among them) keep their arrival order. O(1) for the common case (the newcomer goes last)."""
    key = (seq.request.priority, seq.request.arrival_time)
    if not waiting or (waiting[-1].request.priority, waiting[-1].request.arrival_time) <= key:
        waiting.append(seq)
        return
    i = len(waiting)
    while i > 0 and (waiting[i - 1].request.priority, waiting[i - 1].request.arrival_time) > key:
        i -= 1
    waiting.insert(i, seq)


class BaseScheduler(ABC):
    """The requests a replica holds, and the calls the core loop makes on them (module docstring).

    Args:
        engine_id: the replica's id, stamped on its outputs.
        stats: the replica's heartbeat payload; the scheduler keeps its counters and rates.
        max_num_seqs: batch capacity (running sequences).
        max_model_len: prompt + output tokens per request (what the model's runner serves).
    """

    # acceptance outputs (the api learns which replica holds a request) are sent before each step, which may be
    # a long prefill; a scheduler whose step is short may let them travel with the step's own outputs
    flush_before_step = True

    def __init__(self, engine_id: str, stats: EngineStats, max_num_seqs: int, max_model_len: int):
        self.engine_id = engine_id
        self.stats = stats
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self._early_aborts: dict[str, float] = {}  # request id -> monotonic time the abort arrived
        self._out: Outputs = {}

    # ------------------------------------------------------------------ what a backend says
    @abstractmethod
    def _prepare(self, seq: Sequence) -> None:
        """Validate ``seq``'s request and set up what its scheduling needs; raises ``RequestError`` with a
        client-facing message when it cannot run (any other exception reads as a bad request, logged)."""

    @abstractmethod
    def active(self) -> list[Sequence]:
        """The sequences held past the waiting queue (prefilling, running, handed to the model's engine)."""

    @abstractmethod
    def _abort_active(self, ids: set[str]) -> None:
        """End the active sequences of ``ids`` with ``abort`` and free what they hold."""

    @abstractmethod
    def _forget_all(self) -> None:
        """Drop every held sequence (the replica shuts down; their outputs are made)."""

    @abstractmethod
    def step(self) -> Iterator[Outputs]:
        """Run one engine iteration, yielding its outputs in the parts to publish, in order (module docstring).
        The caller must exhaust the iterator: a part is yielded before the rest of the step has run."""

    def _new_sequence(self, req: EngineCoreRequest) -> Sequence:
        """The engine-side state of a request just read (its own random source, seeded when it asks)."""
        return Sequence(request=req, queued_ts=now(), rng=make_rng(req.sampling_params.seed))

    def start(self) -> None:
        """Prepare to serve (the replica's loop starts); nothing by default."""
        return None

    def shutdown(self) -> None:
        """Free what the scheduler runs besides the model (thread pools, the model's engine); nothing by default."""
        return None

    def wait_if_blocked(self) -> None:
        """With waiting requests of which none can start yet, wait a little instead of spinning on the link;
        nothing by default."""
        return None

    # ------------------------------------------------------------------ the core's calls
    @property
    def num_held(self) -> int:
        """Requests held: waiting and active."""
        return len(self.waiting) + len(self.active())

    def held(self) -> list[Sequence]:
        """Every held sequence: the waiting ones, then the active ones."""
        return [*self.waiting, *self.active()]

    def client_ids(self) -> set[str]:
        """The api processes (``client_id``) the held requests came from."""
        return {s.request.client_id for s in self.held()}

    def requests_of(self, clients: set[str]) -> set[str]:
        """The ids of the held requests that came from ``clients``."""
        return {s.request_id for s in self.held() if s.request.client_id in clients}

    def current_stats(self) -> EngineStats:
        """``stats`` with the current load (``num_running``, ``num_waiting``, ``num_waiting_tokens``); called from the
        heartbeat thread."""
        waiting = list(self.waiting)
        self.stats.num_running = len(self.active())
        self.stats.num_waiting = len(waiting)
        self.stats.num_waiting_tokens = sum(len(s.request.prompt_token_ids) for s in waiting)
        return self.stats

    def accept(self, requests: Iterable[EngineCoreRequest]) -> Outputs:
        """Take ``requests`` (module docstring); returns their first outputs."""
        for req in requests:
            self._accept_one(req)
        return self._take()

    def abort(self, ids: set[str]) -> Outputs:
        """End the held requests of ``ids`` with ``abort``; remember the others a while (module docstring). Returns
        the abort outputs."""
        held = {s.request_id for s in self.held()}
        t = time.monotonic()
        for rid in ids - held:
            self._early_aborts[rid] = t
        if len(self._early_aborts) > EARLY_ABORTS_MAX or (self._early_aborts and
                                                          t - next(iter(self._early_aborts.values())) > EARLY_ABORT_S):
            self._early_aborts = {k: v for k, v in self._early_aborts.items() if t - v <= EARLY_ABORT_S}
        for seq in [s for s in self.waiting if s.request_id in ids]:
            self.waiting.remove(seq)
            self._finish_out(seq, FINISH_ABORT)
        self._abort_active(ids)
        return self._take()

    def fail_all(self, message: str) -> Outputs:
        """End every held request with ``error`` ``message`` and drop them; returns those outputs."""
        for s in self.held():
            if s.finish_reason is None:
                self._finish_out(s, FINISH_ERROR, message)
        self.waiting.clear()
        self._forget_all()
        return self._take()

    # ------------------------------------------------------------------ helpers
    def _accept_one(self, req: EngineCoreRequest) -> None:
        seq = self._new_sequence(req)
        base = _OutputBase(request_id=req.request_id, queued_ts=seq.queued_ts, engine_id=self.engine_id)
        try:
            self._prepare(seq)
        except RequestError as exc:
            self._emit(req.client_id, EngineCoreOutput(finish_reason=FINISH_ERROR, error=str(exc), **base))
            return
        except Exception as exc:  # never let one request kill the engine
            log.exception("request %s rejected", req.request_id)
            self._emit(req.client_id, EngineCoreOutput(finish_reason=FINISH_ERROR, error=f"bad request: {exc}",
                                                       **base))
            return
        self._emit(req.client_id, EngineCoreOutput(**base))
        if self._early_aborts.pop(req.request_id, None) is not None:
            self._finish_out(seq, FINISH_ABORT)
            return
        enqueue_by_priority(self.waiting, seq)

    def _emit(self, client_id: str, out: EngineCoreOutput) -> None:
        self._out.setdefault(client_id, []).append(out)

    def _finish_out(self, seq: Sequence, reason: str, error: str | None = None, error_code: str | None = None) -> None:
        self._emit(seq.request.client_id, EngineCoreOutput(
            request_id=seq.request_id, finish_reason=reason, error=error, engine_id=self.engine_id,
            error_code=error_code))

    def _take(self) -> Outputs:
        """The outputs made since the last call (and forget them)."""
        out, self._out = self._out, {}
        return out
