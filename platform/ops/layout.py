"""How ``manage.py serve`` shares one machine's cores between the api and the engines (issue 17, D-160).

A CPU engine that takes every core (torch's default) leaves the api process only preempted slices: with four
engines on two cores a 503 took ~0.5 s. So serve gives each CPU engine ``engine_threads`` torch intra-op threads,
the cores left after the frontend's share split evenly among the engines (vLLM's CPU guide likewise reserves
cores for the serving frontend), and starts every engine at a lower CPU priority (``nice``), so that when the
cores are oversubscribed anyway (more engines than cores) the api's event loop is scheduled first. Background
work (usage writes, beat, image preprocessing) runs at ``BACKGROUND_NICE`` too; the api processes, the render
worker (on every request's path) and Redis keep the default priority.
"""

from __future__ import annotations

from dataclasses import dataclass

# niceness of the processes whose work may lag under load without a client waiting on it: the usage writer, beat,
# and image preprocessing (the mm worker: image chats wait on it, text never does)
BACKGROUND_NICE = 10
# serve's defaults (settings SERVE_ENGINE_NICE, SERVE_FRONTEND_RESERVED_CORES): engines at niceness 10, one core
# left to the frontend by the automatic engine threads
DEFAULT_ENGINE_NICE = 10
DEFAULT_FRONTEND_RESERVED_CORES = 1


@dataclass(frozen=True)
class EngineLayout:
    """What serve starts each engine with: ``threads`` torch intra-op threads (CPU engines; passed as
    ``--num-threads``) and ``nice``, the niceness increment applied in the child before it executes (0..19)."""

    threads: int
    nice: int


def engine_threads(cores: int, engines: int, reserved: int) -> int:
    """Torch intra-op threads per CPU engine: ``max(1, (cores - reserved) // engines)``.

    ``cores``: CPUs the engines may run on; ``engines``: CPU engine processes sharing them; ``reserved``: cores
    kept for the api processes, workers and Redis (never more than ``cores - 1``, so one engine always gets a
    thread). Raises ``ValueError`` on a negative ``reserved`` or fewer than one core."""
    if cores < 1:
        raise ValueError(f"cores must be at least 1, got {cores}")
    if reserved < 0:
        raise ValueError(f"reserved cores must be 0 or more, got {reserved}")
    usable = cores - min(reserved, cores - 1)
    return max(1, usable // max(1, engines))


def engine_layout(*, cores: int, cpu_engines: int, reserved: int, threads: int, nice: int) -> EngineLayout:
    """The engines' layout: ``threads`` when the operator gave one (> 0), else ``engine_threads(cores,
    cpu_engines, reserved)``; ``nice`` as given. Raises ``ValueError`` when ``nice`` is outside 0..19 (an
    unprivileged process may only lower its priority), ``threads`` or ``reserved`` is negative."""
    if not 0 <= nice <= 19:
        raise ValueError(f"engine niceness must be within 0..19, got {nice}")
    if threads < 0:
        raise ValueError(f"engine threads must be 0 (automatic) or more, got {threads}")
    automatic = engine_threads(cores, cpu_engines, reserved)
    return EngineLayout(threads=threads or automatic, nice=nice)


def render_children(concurrency: int, workers: int) -> list[int]:
    """Prefork children of each of serve's render worker processes: ``concurrency`` split as evenly as possible among
    ``workers`` processes (at least one process), at least one child each (``2, 3`` gives ``[1, 1, 1]``). Two
    processes by default so that one's death leaves the other serving (DECISIONS D-192)."""
    workers = max(1, workers)
    concurrency = max(concurrency, workers)
    return [concurrency // workers + (1 if i < concurrency % workers else 0) for i in range(workers)]


# Celery pools a render worker may run (``serve --render-pool``; DECISIONS D-296).
RENDER_POOLS = ("solo", "prefork")


def render_processes(pool: str, concurrency: int, workers: int) -> list[int]:
    """Pool size (``-c``) of each render worker process ``serve`` starts: ``prefork``, ``render_children``;
    ``solo``, one process per render slot of that split (``[1] * max(concurrency, workers)``, ``workers`` ≥ 1), each
    rendering in its own process. Raises ``ValueError`` for another pool."""
    if pool not in RENDER_POOLS:
        raise ValueError(f"render pool must be one of {RENDER_POOLS}, got {pool!r}")
    children = render_children(concurrency, workers)
    return children if pool == "prefork" else [1] * sum(children)


def render_worker_env(pool: str, redeliver_after_s: float) -> dict[str, str]:
    """Environment of a render worker process: the broker's visibility timeout (``CELERY_REDELIVER_AFTER_S``), and
    for ``solo`` a prefetch of one task: a solo worker renders one task at a time, so any task it prefetched beyond
    that would wait behind it while another worker sits idle (a prefork worker's children share its prefetch)."""
    env = {"CELERY_REDELIVER_AFTER_S": str(redeliver_after_s)}
    if pool == "solo":
        env["CELERY_WORKER_PREFETCH_MULTIPLIER"] = "1"
    return env
