"""Concurrent cache misses share one lookup (gateway/single_flight.py, DECISIONS D-302).

A burst of requests with one key and one model after an idle second used to run one ORM lookup per request for
the key and one for the model; these tests hold the helper to its rules and then check, on the real database and
the real selectors (counted, not replaced), that a cold burst of 16 reads each row once, that an invalidation
during a lookup still makes the next caller read again, and that a caller that leaves does not cancel the lookup
another caller waits on."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from gateway.single_flight import SingleFlight
from tests.support.redis import TEST_REDIS_URL, fresh_prefix, redis_or_skip

BURST = 16


# ------------------------------------------------------------------------------------------------ the helper
def test_concurrent_callers_share_one_fetch_and_a_leaving_caller_cancels_nothing():
    calls = []

    async def main():
        flight: SingleFlight[str] = SingleFlight()
        release = asyncio.Event()

        async def fetch():
            calls.append(1)
            await release.wait()
            return "row"

        callers = [asyncio.ensure_future(flight.run("k", fetch)) for _ in range(BURST)]
        await asyncio.sleep(0)
        assert flight.in_flight() == 1
        callers[0].cancel()  # its client went away
        await asyncio.sleep(0)
        release.set()
        results = await asyncio.gather(*callers[1:])
        assert callers[0].cancelled()
        assert results == ["row"] * (BURST - 1)
        assert flight.in_flight() == 0
        assert await flight.run("k", fetch) == "row"  # nothing kept: a later miss fetches again

    asyncio.run(main())
    assert len(calls) == 2


def test_a_failed_fetch_reaches_every_caller_and_is_not_kept():
    calls = []

    async def main():
        flight: SingleFlight[int] = SingleFlight()

        async def failing():
            calls.append(1)
            await asyncio.sleep(0.01)
            raise LookupError("database down")

        results = await asyncio.gather(*(flight.run("k", failing) for _ in range(4)), return_exceptions=True)
        assert all(isinstance(r, LookupError) for r in results)
        assert flight.in_flight() == 0

        async def working():
            calls.append(1)
            return 7

        assert await flight.run("k", working) == 7

    asyncio.run(main())
    assert len(calls) == 2


def test_another_tag_or_key_starts_its_own_fetch():
    seen = []

    async def main():
        flight: SingleFlight[str] = SingleFlight()

        def fetch(label):
            async def run():
                seen.append(label)
                await asyncio.sleep(0.01)
                return label
            return run

        out = await asyncio.gather(flight.run("k", fetch("gen0"), tag=0), flight.run("k", fetch("gen0-again"), tag=0),
                                   flight.run("k", fetch("gen1"), tag=1), flight.run("other", fetch("other")))
        assert out == ["gen0", "gen0", "gen1", "other"]

    asyncio.run(main())
    assert sorted(seen) == ["gen0", "gen1", "other"]


# ------------------------------------------------------------------------------- the caches on the database
class Counted:
    """Calls the real function and counts the calls; ``gate`` (when set) holds every call until it is set."""

    def __init__(self, real):
        self.real, self.calls, self.gate = real, 0, None
        self.lock = threading.Lock()

    def __call__(self, *args):
        with self.lock:
            self.calls += 1
        if self.gate is not None:
            assert self.gate.wait(30)
        return self.real(*args)


@pytest.fixture
def keyed(settings, monkeypatch):
    """A tenant's key and a served model in the test database, the gateway on a fresh Redis prefix, the two
    selectors counted, and both caches empty."""
    from django.db import connections

    from gateway import auth, model_cache
    from gateway import clients
    from registry.services import served_model_register
    from tenancy.services import api_key_create, tenant_get_or_create
    from harness.assets import MODEL_DIR

    if not (Path(MODEL_DIR) / "config.json").exists():
        pytest.skip(f"{MODEL_DIR} missing: run scripts/setup.sh")
    redis_or_skip().close()
    # the lookups run in the event loop's executor threads, which end with each asyncio.run: their connections are
    # closed after each lookup (as on SQLite), not kept open past the test for the test database's teardown to trip on
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    with fresh_prefix("sflight") as prefix:
        settings.REDIS_URL, settings.LINK_PREFIX = TEST_REDIS_URL, prefix
        clients._pools.clear()
        served_model_register(served_model_name="sf-model", model_dir=str(MODEL_DIR))
        _key, secret = api_key_create(tenant=tenant_get_or_create(name="sf-tenant"), name="burst")
        key_check = Counted(auth.api_key_check)
        snapshot = Counted(model_cache.served_model_snapshot)
        monkeypatch.setattr(auth, "api_key_check", key_check)
        monkeypatch.setattr(model_cache, "served_model_snapshot", snapshot)
        auth._cache.clear()
        model_cache._cache.clear()
        yield secret, key_check, snapshot
        auth._cache.clear()
        model_cache._cache.clear()
        clients._pools.clear()


@pytest.mark.django_db(transaction=True)
def test_a_cold_burst_reads_the_key_and_the_model_once(keyed):
    from gateway import auth, model_cache

    secret, key_check, snapshot = keyed
    headers = [(b"authorization", f"Bearer {secret}".encode())]

    async def one():
        return await auth.authenticate(headers), await model_cache.get_model("sf-model")

    async def burst():
        return await asyncio.gather(*(one() for _ in range(BURST)))

    results = asyncio.run(burst())
    assert key_check.calls == 1 and snapshot.calls == 1
    assert {ctx.tenant_name for ctx, _ in results} == {"sf-tenant"}
    assert {snap.served_model_name for _, snap in results} == {"sf-model"}
    auth._cache.clear()
    model_cache._cache.clear()
    asyncio.run(burst())  # a second cold burst reads once more, no more
    assert key_check.calls == 2 and snapshot.calls == 2


async def _until(condition, what: str, timeout_s: float = 10.0) -> None:
    """Poll ``condition()`` every 10 ms; fail the test (instead of hanging) after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def _listening(auth) -> None:
    """Start this loop's invalidation listener and wait for its subscription (which clears the cache and bumps its
    generation), so that nothing but the test moves the generation afterwards."""
    before = auth._cache.generation
    auth.listener_ensure()
    await _until(lambda: auth._cache.generation != before, "the invalidation listener's subscription")


def _gated(keyed):
    """The ``keyed`` fixture's secret, its counted key check held at a gate (``key_check.gate``, set to let the
    lookups go on) and the request headers that carry the key."""
    secret, key_check, _snapshot = keyed
    key_check.gate = threading.Event()
    return secret, key_check, [(b"authorization", f"Bearer {secret}".encode())]


@pytest.mark.django_db(transaction=True)
def test_an_invalidation_during_a_lookup_makes_the_next_caller_read_again(keyed):
    from gateway import auth

    secret, key_check, headers = _gated(keyed)

    async def main():
        await _listening(auth)
        generation = auth._cache.generation
        try:
            first = asyncio.ensure_future(auth.authenticate(headers))
            await _until(lambda: key_check.calls >= 1, "the first lookup")  # running, held at the gate
            assert auth._cache.generation == generation
            auth._cache.drop_key(secret.partition(".")[0])  # the key changed while it ran
            second = asyncio.ensure_future(auth.authenticate(headers))
            await _until(lambda: key_check.calls >= 2, "a second lookup")  # not shared with the older one
        finally:
            key_check.gate.set()
        return await first, await second

    first, second = asyncio.run(main())
    assert first.tenant_name == second.tenant_name == "sf-tenant"
    assert key_check.calls == 2


@pytest.mark.django_db(transaction=True)
def test_a_caller_that_leaves_does_not_cancel_the_lookup_the_others_wait_on(keyed):
    from gateway import auth

    _secret, key_check, headers = _gated(keyed)

    async def main():
        await _listening(auth)
        try:
            leaving = asyncio.ensure_future(auth.authenticate(headers))
            await _until(lambda: key_check.calls >= 1, "the lookup")
            staying = asyncio.ensure_future(auth.authenticate(headers))
            await asyncio.sleep(0.05)
            leaving.cancel()  # its client went away
            await asyncio.sleep(0.05)
        finally:
            key_check.gate.set()
        ctx = await staying
        assert leaving.cancelled()
        return ctx

    assert asyncio.run(main()).tenant_name == "sf-tenant"
    assert key_check.calls == 1


def test_a_fetch_older_than_max_age_is_not_joined():
    calls = []

    async def main():
        flight: SingleFlight[int] = SingleFlight()
        release = asyncio.Event()

        async def slow():
            calls.append(1)
            await release.wait()
            return len(calls)

        old = asyncio.ensure_future(flight.run("k", slow, max_age_s=0.05))
        await asyncio.sleep(0.1)  # the first lookup is stuck past the age a caller may be given
        new = asyncio.ensure_future(flight.run("k", slow, max_age_s=0.05))
        await asyncio.sleep(0)
        release.set()
        return await old, await new

    first, second = asyncio.run(main())
    assert len(calls) == 2 and first == second == 2
