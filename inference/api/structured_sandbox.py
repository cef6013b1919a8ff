"""The api's grammar sandbox: client grammars, regular expressions and JSON schemas are compiled in separate
processes, each compile under a CPU-time budget, a few per tenant at a time (issue 39).

Why a process: the grammar work that is not llguidance's native code (its format sniffing, its GBNF converter, our
schema checks) is Python and holds the GIL; on a thread of the api it stalled the event loop, authentication and
every other tenant's requests for seconds, and in an engine it stopped the heartbeat. In a process of its own a
pathological input burns only its own budget:

* ``STRUCTURED_COMPILE_PROCESSES`` worker processes per api process (``pebble.ProcessPool``, spawned, so nothing of
  the api's threads or sockets is inherited), at nice 10 below the api's event loop, with no core files, an
  address-space cap (``STRUCTURED_COMPILE_MAX_BYTES``) and the parent-death signal set (a killed api leaves none
  behind). A worker that dies is replaced by the pool.
* Each compile arms a CPU-time timer (``setitimer(ITIMER_PROF)``, user + system time of the process) for
  ``STRUCTURED_COMPILE_CPU_S``; its signal's default action ends the process wherever it is, native code included.
  A compile that ends that way is a ``StructuredSpecError`` ("could not be compiled within its budget"): the
  gateway's 400 naming the field. A wall-clock bound (``WALL_FACTOR`` × the budget) ends a worker that stops making
  progress at all.
* At most ``STRUCTURED_COMPILE_PER_TENANT`` compiles of one tenant run at once (more wait their turn; the slot is
  held until the compile ends even when its client went away), so one tenant's flood of schemas leaves the other
  worker processes to everyone else. A tenant whose compile was ended for its budget is a *suspect* for
  ``SUSPECT_S``: all suspects together hold at most ``processes - 1`` workers, so two or more tenants flooding
  costly schemas still leave one worker to everyone else (without it, two tenants held both workers and a third's
  trivial schema waited 1.3 s at the median).
* Results (the engine form, or the error) are kept in an LRU keyed by ``spec_key(kind, spec, cache scope)``: a
  repeated schema costs a lookup, and only callers of the same cache scope share an entry (a cache shared across
  tenants would tell one, by its timing, which schemas another sent).

Django-free; asyncio. One sandbox per api process (``sandbox()``); a worker is started on the first compile.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import resource
import signal
import threading
import time
from collections import OrderedDict
from concurrent.futures import CancelledError as FutureCancelled, Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from pebble import ProcessExpired, ProcessPool

from inference.shared.config import SETTINGS
from inference.shared.structured import check
from inference.shared.structured_caps import StructuredSpecError

CPU_BUDGET_S = SETTINGS.structured_compile_cpu_s
PROCESSES = SETTINGS.structured_compile_processes
PER_TENANT = SETTINGS.structured_compile_per_tenant
MAX_BYTES = SETTINGS.structured_compile_max_bytes
CACHE_SIZE = SETTINGS.structured_compile_cache_size
WALL_FACTOR = 20  # wall-clock bound of one compile, in budgets (a worker starved of CPU still gets its budget)
WALL_MIN_S = 10.0
SUSPECT_S = 60.0  # how long a tenant whose compile was ended for its budget shares the suspects' workers
_PR_SET_PDEATHSIG = 1


OUTCOMES = ("ok", "invalid", "budget")


def counters_key(prefix: str) -> str:
    """Redis hash of the api processes' compile counts: ``ok`` / ``invalid`` / ``budget`` (``CompileResult.outcome``)
    and ``cpu_s``, the CPU seconds they took (``/metrics``: ``structured_compiles_total``,
    ``structured_compile_cpu_seconds_total``)."""
    return f"{prefix}:structured:compiles"


class SandboxUnavailable(RuntimeError):
    """The sandbox's process pool broke (its workers cannot be started): the gateway answers 503."""


@dataclass(frozen=True)
class CompileResult:
    """One compile's outcome: ``engine_form`` (``inference.shared.structured.check``'s result) or ``error`` (the
    ``StructuredSpecError`` message); ``cpu_s`` the CPU seconds it took (the budget when it was ended for it);
    ``outcome`` ``ok``, ``invalid`` or ``budget``; ``cached`` whether it came from the cache."""

    engine_form: str | None
    error: str | None
    cpu_s: float
    outcome: str
    cached: bool = False

    def value(self) -> str:
        """The engine form; raises ``StructuredSpecError`` with the error instead."""
        if self.error is not None:
            raise StructuredSpecError(self.error)
        assert self.engine_form is not None
        return self.engine_form


def _init_worker(max_bytes: int) -> None:
    """Worker start: lower priority, no core files, an address-space cap, killed with its parent. (The grammar code
    is imported with this module, before the first compile's budget starts.)"""
    os.nice(10)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if max_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (max_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the pool's own pipe closing ends the worker instead
        pass
    if os.getppid() == 1:  # the parent died before the signal was set
        os._exit(1)
    signal.signal(signal.SIGPROF, signal.SIG_DFL)  # the budget's timer: the default action ends the process


def _compile(kind: str, spec: str, budget_s: float) -> tuple[str | None, str | None, float]:
    """In a worker: ``inference.shared.structured.check(kind, spec)`` under a CPU-time timer of ``budget_s`` seconds.
    Returns ``(engine form, None, cpu_s)`` or ``(None, error message, cpu_s)``; past the budget the process is
    ended by ``SIGPROF`` (the parent sees the worker expire)."""
    start = time.process_time()
    signal.setitimer(signal.ITIMER_PROF, budget_s)
    try:
        form, error = check(kind, spec), None
    except StructuredSpecError as exc:
        form, error = None, str(exc)
    except RecursionError:
        form, error = None, "nests too deeply"
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
    return form, error, time.process_time() - start


@dataclass
class _Held:
    """The slots one compile holds: its tenant's, and the suspects' one when its tenant is a suspect."""

    tenant: str
    semaphores: list[asyncio.Semaphore]
    users: list[int]


class GrammarSandbox:
    """Compiles constraints in worker processes (module docstring).

    Args:
        processes: worker processes; budget_s: CPU seconds per compile; per_tenant: a tenant's compiles at once;
        max_bytes: a worker's address space (0: no cap); cache_size: results kept (LRU).
    """

    def __init__(self, processes: int = PROCESSES, budget_s: float = CPU_BUDGET_S, per_tenant: int = PER_TENANT,
                 max_bytes: int = MAX_BYTES, cache_size: int = CACHE_SIZE):
        self.processes = max(1, processes)
        self.budget_s = budget_s
        self.per_tenant = max(1, per_tenant)
        self.max_bytes = max_bytes
        self.cache_size = cache_size
        self._pool: ProcessPool | None = None
        self._pool_lock = threading.Lock()
        self._cache: OrderedDict[str, CompileResult] = OrderedDict()
        self._tenants: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}  # tenant → (slots, [users])
        self._suspects: dict[str, float] = {}  # tenant → monotonic time its suspicion ends
        self._suspect_slots = asyncio.Semaphore(max(1, self.processes - 1))

    # ------------------------------------------------------------------ pool
    def _get_pool(self) -> ProcessPool:
        with self._pool_lock:
            if self._pool is None or not self._pool.active:
                self._pool = ProcessPool(max_workers=self.processes, initializer=_init_worker,
                                         initargs=(self.max_bytes,), context=multiprocessing.get_context("spawn"))
            return self._pool

    def _reset_pool(self, pool: ProcessPool) -> None:
        with self._pool_lock:
            if self._pool is pool:
                self._pool = None
        pool.stop()  # type: ignore[no-untyped-call]

    def close(self) -> None:
        """Stop the workers (running compiles are ended)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()  # type: ignore[no-untyped-call]
            pool.join(timeout=5)

    def worker_pids(self) -> list[int]:
        """The live worker processes' ids (empty before the first compile)."""
        pool = self._pool
        if pool is None:
            return []
        return [pid for pid in list(pool._pool_manager.worker_manager.workers) if pid]

    # ------------------------------------------------------------------ cache
    def cached(self, key: str) -> CompileResult | None:
        """The cached result under ``key`` (``spec_key(kind, spec, scope)``), or None."""
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
        return hit

    def _remember(self, key: str, result: CompileResult) -> None:
        self._cache[key] = result
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    # ------------------------------------------------------------------ compile
    async def compile(self, kind: str, spec: str, *, key: str, tenant: str) -> CompileResult:
        """The compile result of ``(kind, spec)`` (``inference.shared.structured.check``) for a caller of tenant ``tenant``
        whose cache key is ``key`` (``spec_key(kind, spec, cache scope)``): from the cache, or from a worker once
        the tenant has a free slot. A compile ended for its budget is an ``error`` result (outcome ``budget``).
        Raises ``SandboxUnavailable`` when the pool cannot run it. Cancelling the caller leaves a running compile
        to finish (its result is cached and its tenant slot held until then)."""
        hit = self.cached(key)
        if hit is not None:
            return CompileResult(hit.engine_form, hit.error, 0.0, hit.outcome, cached=True)
        loop = asyncio.get_running_loop()
        held = await self._take_slots(tenant)
        hit = self.cached(key)  # compiled by this tenant's previous request meanwhile
        if hit is not None:
            self._give_back(held)
            return CompileResult(hit.engine_form, hit.error, 0.0, hit.outcome, cached=True)
        try:
            pool = self._get_pool()
            future = pool.schedule(_compile, args=(kind, spec, self.budget_s),
                                   timeout=max(WALL_MIN_S, WALL_FACTOR * self.budget_s))
        except BaseException:
            self._give_back(held)
            raise
        done: asyncio.Future[CompileResult] = loop.create_future()

        def finished(f: Future[tuple[str | None, str | None, float]]) -> None:
            loop.call_soon_threadsafe(self._finish, f, key, held, pool, done)

        future.add_done_callback(finished)
        return await asyncio.shield(done)

    def suspect(self, tenant: str) -> bool:
        """Whether ``tenant`` had a compile ended for its budget in the last ``SUSPECT_S`` seconds."""
        until = self._suspects.get(tenant)
        if until is not None and until <= time.monotonic():
            del self._suspects[tenant]
            return False
        return until is not None

    async def _take_slots(self, tenant: str) -> _Held:
        """Wait for one of ``tenant``'s slots and, while it is a suspect, for one of the suspects' slots too (all
        suspects together hold at most ``processes - 1`` workers: one is always left to the others)."""
        slots, users = self._tenants.setdefault(tenant, (asyncio.Semaphore(self.per_tenant), [0]))
        users[0] += 1
        held = _Held(tenant, [], users)
        try:
            await slots.acquire()
            held.semaphores.append(slots)
            if self.suspect(tenant):
                await self._suspect_slots.acquire()
                held.semaphores.append(self._suspect_slots)
        except BaseException:
            self._give_back(held)
            raise
        return held

    def _give_back(self, held: _Held) -> None:
        """Release what ``_take_slots`` took; the tenant's last caller forgets its slots."""
        for semaphore in held.semaphores:
            semaphore.release()
        held.semaphores.clear()
        held.users[0] -= 1
        if held.users[0] == 0 and self._tenants.get(held.tenant, (None, None))[1] is held.users:
            del self._tenants[held.tenant]

    def _finish(self, future: Future[tuple[str | None, str | None, float]], key: str, held: _Held,
                pool: ProcessPool, done: asyncio.Future[CompileResult]) -> None:
        """On the loop, when a worker's compile ended: its result (cached unless the pool failed), the tenant's
        slots given back (a compile ended for its budget makes its tenant a suspect for ``SUSPECT_S``), the waiting
        caller answered."""
        self._give_back(held)
        try:
            form, error, cpu_s = future.result()
            result = CompileResult(form, error, cpu_s, "ok" if error is None else "invalid")
        except (ProcessExpired, TimeoutError) as exc:  # ended for its budget (SIGPROF), its memory cap or the wall
            reason = "CPU time" if isinstance(exc, TimeoutError) or getattr(exc, "exitcode", 0) == -signal.SIGPROF \
                else "CPU time or memory"
            result = CompileResult(None, f"could not be compiled within its budget ({self.budget_s:g} s of "
                                         f"{reason}); simplify it", self.budget_s, "budget")
            self._suspects[held.tenant] = time.monotonic() + SUSPECT_S
        except (BrokenProcessPool, FutureCancelled, OSError) as exc:
            self._reset_pool(pool)
            if not done.done():
                done.set_exception(SandboxUnavailable(f"grammar sandbox unavailable: {exc!r}"))
            return
        self._remember(key, result)
        if not done.done():
            done.set_result(result)


_SANDBOXES: dict[int, GrammarSandbox] = {}
_SANDBOXES_LOCK = threading.Lock()


def sandbox() -> GrammarSandbox:
    """This process's sandbox (created on first use; its workers on the first compile)."""
    with _SANDBOXES_LOCK:
        box = _SANDBOXES.get(os.getpid())
        if box is None:
            box = _SANDBOXES[os.getpid()] = GrammarSandbox()
        return box
