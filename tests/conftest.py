"""Fixtures shared across test directories. A session fixture must be defined once here rather than imported
into test modules: pytest makes one instance per module that imports it, and each live platform holds ~2 GB."""

from __future__ import annotations

import sys

import pytest

from harness.assets import VL_DIR, VL_MODEL, ensure_vl_model
from tests.support.live import join_stops, running_platform, start_replica

# the ``live`` marker, set by a rule, and its guard (``-m "not live"``: the fast loop)
pytest_plugins = ("tests.support.live_marker",)


@pytest.fixture(scope="session")
def shared_live(tmp_path_factory):
    """One live platform with the default set-up (``start_platform``: the demo model ``tiny-qwen3`` and its engine,
    render/usage/mm workers, beat, api) for every package whose tests leave it as they found it (e2e, usage,
    agent_output_live, conformance, frontend); a package adds what it needs on top (``ensure_model``,
    ``ensure_inline_api``). Packages that change the platform's limits or kill its processes start their own."""
    with running_platform(tmp_path_factory.mktemp("shared-live")) as live:
        yield live


@pytest.fixture(scope="session")
def live_vl(tmp_path_factory):
    """Live platform serving the demo Qwen2-VL model (``VL_MODEL``) with an ``mm`` worker that may fetch from
    127.0.0.1 (``MM_FETCH_ALLOW_NETS``) and a 3 s fetch deadline."""
    ensure_vl_model()
    with running_platform(tmp_path_factory.mktemp("live-vl"), engine=False, max_model_len=1024,
                          mm_worker=False) as live:  # its own mm worker below may fetch from loopback
        live.manage("register_model", VL_MODEL, str(VL_DIR), "--max-model-len", "1024")
        env = dict(live.env, MM_FETCH_ALLOW_NETS="127.0.0.1/32", MM_FETCH_TIMEOUT_S="3")
        live.sup.env = env
        live.sup.start("mm-worker", [sys.executable, "-m", "celery", "-A", "config", "worker", "-Q", "mm", "-c", "1",
                                     "-I", "inference.workers.mm_tasks", "--pool", "prefork", "-n", f"mm-{live.prefix}@%h",
                                     "--without-gossip", "--without-mingle", "-l", "WARNING"])
        start_replica(live, "vl-engine", VL_MODEL, VL_DIR, "--max-model-len", "1024", "--num-threads", "2")
        yield live


@pytest.fixture
async def db_connections_closed_in_their_threads():
    """For a test that reaches the database from threads other than its own: asgiref's ``sync_to_async`` and
    Django's ``AsyncClient`` (asgiref's one thread-sensitive thread, which lives as long as the process), Django's
    ASGI handler (a thread per request) and Channels' ``database_sync_to_async`` (the test's event loop's executor,
    whose threads end with the test). pytest-django closes only the main thread's connections; on PostgreSQL
    (``CONN_MAX_AGE`` 60 s) the others stay open, in live threads or until the garbage collector finds those of
    ended ones, and the test database cannot be dropped at the end of the session ("There is 1 other session using
    the database"). So each request and lookup closes its connection at its end, in its own thread, as Django does
    with ``CONN_MAX_AGE`` 0 (which Django advises under ASGI), and at teardown the thread-sensitive thread closes
    the one it holds."""
    from asgiref.sync import sync_to_async
    from django.db import connections

    with pytest.MonkeyPatch.context() as mp:
        for db in connections.settings.values():
            mp.setitem(db, "CONN_MAX_AGE", 0)
        yield
    await sync_to_async(connections.close_all)()  # thread-sensitive: runs in the thread that holds that connection


def pytest_sessionfinish(session, exitstatus):
    """Wait for the platforms and engines still stopping (``tests.support.live.stop_in_background``)."""
    for error in join_stops():
        print(f"\nwarning: a fixture's stop failed: {error}", file=sys.stderr)
