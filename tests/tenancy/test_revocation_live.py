"""Revocation on the shared live platform (``shared_live``) with a second api process of this module's own (two api
processes): a key revoked (or rotated, or its tenant deactivated)
through the control plane is refused by every api process within milliseconds (Redis Pub/Sub invalidation of the
per-process auth cache, gateway/auth.py), not after the cache's 1 s lifetime; refused attempts are counted per key
prefix in ``/metrics`` with bounded labels.

The figures printed are the measured delays, from the revoking response, until each process refuses the key.
Goal ≤ 100 ms; asserted ≤ 500 ms (well under the 1 s the cache alone would take) to stay robust on a loaded box.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time
import uuid

import httpx
import pytest

from gateway.auth import _COUNT_LUA
from tests.support.live import stop_child

pytestmark = pytest.mark.timeout(240)
BOUND_S = 0.5


@pytest.fixture(scope="module")
def live(shared_live):
    try:
        _child, shared_live.extra["api2"] = shared_live.start_api("api2")
        shared_live.extra["writer"] = shared_live.new_key(tenant="rev", scopes="inference,keys:write")
        shared_live.extra["operator"] = shared_live.new_key(tenant="ops", scopes="operator")
        yield shared_live
    finally:
        stop_child(shared_live, "api2")
        for name in ("api2", "writer", "operator"):
            shared_live.extra.pop(name, None)


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def _new_key(client: httpx.AsyncClient, live) -> dict:
    r = await client.post(f"{live.base_url}/api/v1/keys", headers=_auth(live.extra["writer"]),
                          json={"name": f"v-{uuid.uuid4().hex[:6]}", "scopes": ["inference"]})
    assert r.status_code == 201, r.text
    return r.json()


async def _refusal_delays(live, secret: str, change) -> list[float]:
    """Warm both processes' caches with ``secret`` (200 each), run ``change()`` (an awaitable making the key
    unusable), then poll both processes until each answers 401; the delays from ``change``'s return."""
    bases = [live.base_url, live.extra["api2"]]
    async with httpx.AsyncClient(timeout=10) as client:
        for base in bases:
            assert (await client.get(f"{base}/v1/models", headers=_auth(secret))).status_code == 200
        # the entries now have ~1 s left: a refusal well under that comes from the invalidation
        await change(client)
        done = time.perf_counter()

        async def poll(base: str) -> float:
            while True:
                r = await client.get(f"{base}/v1/models", headers=_auth(secret))
                if r.status_code == 401:
                    return time.perf_counter() - done
                assert r.status_code == 200, r.text
                assert time.perf_counter() - done < 5, "still accepted 5 s after the change"

        return list(await asyncio.gather(*(poll(b) for b in bases)))


def test_revoked_key_is_refused_by_both_api_processes_within_the_bound(live):
    async def run() -> list[float]:
        delays: list[float] = []
        for _ in range(5):
            async with httpx.AsyncClient(timeout=10) as client:
                key = await _new_key(client, live)

            async def revoke(client: httpx.AsyncClient, key=key) -> None:
                r = await client.delete(f"{live.base_url}/api/v1/keys/{key['id']}", headers=_auth(live.extra["writer"]))
                assert r.status_code == 200 and r.json()["status"] == "revoked", r.text

            delays += await _refusal_delays(live, key["key"], revoke)
        return delays

    delays = asyncio.run(run())
    print(f"\nrevocation -> 401 in both api processes, 5 revocations x 2 processes: "
          f"median {statistics.median(delays) * 1000:.1f} ms, max {max(delays) * 1000:.1f} ms "
          f"(all: {', '.join(f'{d * 1000:.1f}' for d in delays)} ms)")
    assert max(delays) <= BOUND_S, delays


def test_rotation_and_tenant_deactivation_are_in_force_at_once(live):
    async def rotate_run() -> list[float]:
        async with httpx.AsyncClient(timeout=10) as client:
            key = await _new_key(client, live)
        successor: dict = {}

        async def rotate(client: httpx.AsyncClient) -> None:
            r = await client.post(f"{live.base_url}/api/v1/keys/{key['id']}/rotate",
                                  headers=_auth(live.extra["writer"]), json={"grace_period_s": 0})
            assert r.status_code == 201, r.text
            successor.update(r.json())

        delays = await _refusal_delays(live, key["key"], rotate)
        async with httpx.AsyncClient(timeout=10) as client:
            for base in (live.base_url, live.extra["api2"]):
                assert (await client.get(f"{base}/v1/models", headers=_auth(successor["key"]))).status_code == 200
        return delays

    delays = asyncio.run(rotate_run())
    print(f"\nrotation (no grace) -> old key 401: {', '.join(f'{d * 1000:.1f}' for d in delays)} ms")
    assert max(delays) <= BOUND_S, delays

    tenant = f"deact-{uuid.uuid4().hex[:6]}"
    secret = live.new_key(tenant=tenant)

    async def deactivate(client: httpx.AsyncClient) -> None:
        await asyncio.to_thread(live.manage, "shell", "-c",
                                f"from tenancy.models import Tenant; t = Tenant.objects.get(name={tenant!r}); "
                                "t.is_active = False; t.save()")

    delays = asyncio.run(_refusal_delays(live, secret, deactivate))
    print(f"tenant deactivated (manage.py shell) -> 401: {', '.join(f'{d * 1000:.1f}' for d in delays)} ms")
    assert max(delays) <= BOUND_S, delays


def _refusals(live) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{live.base_url}/metrics", headers=_auth(live.extra["operator"])).text
    found = {}
    for labels, value in re.findall(r"^gateway_auth_refusals_total\{([^}]*)\} (\S+)$", text, re.M):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        found[(pairs["reason"], pairs["key_prefix"])] = float(value)
    return found


def _wait_counts(live, want: dict[tuple[str, str], float], before: dict) -> dict:
    deadline = time.monotonic() + 5
    while True:
        now = _refusals(live)
        got = {k: now.get(k, 0.0) - before.get(k, 0.0) for k in want}
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_refusals_are_counted_per_revoked_key_prefix_and_unknown_keys_share_one_bucket(live):
    async def make_revoked() -> dict:
        async with httpx.AsyncClient(timeout=10) as client:
            key = await _new_key(client, live)
            r = await client.delete(f"{live.base_url}/api/v1/keys/{key['id']}", headers=_auth(live.extra["writer"]))
            assert r.status_code == 200
            return key

    key = asyncio.run(make_revoked())
    prefix, body = key["key"].split(".", 1)
    before = _refusals(live)
    unknown_prefixes = [f"sk-{uuid.uuid4().hex[:8]}" for _ in range(30)]
    with httpx.Client(timeout=10) as client:
        for base in (live.base_url, live.extra["api2"]):
            for _ in range(3):  # the revoked key, with its own secret: 3 x 2 processes
                assert client.get(f"{base}/v1/models", headers=_auth(key["key"])).status_code == 401
            assert client.get(f"{base}/v1/models", headers=_auth(f"{prefix}.{'A' * len(body)}")).status_code == 401
            for unknown in unknown_prefixes:  # 30 made-up prefixes: one bucket, not 30 series
                assert client.get(f"{base}/v1/models", headers=_auth(f"{unknown}.{body}")).status_code == 401
            assert client.get(f"{base}/v1/models", headers=_auth("not-a-key")).status_code == 401
    want = {("revoked", prefix): 6.0, ("wrong_secret", "unknown"): 2.0, ("unknown_key", "unknown"): 60.0,
            ("malformed", "unknown"): 2.0}
    assert _wait_counts(live, want, before) == want
    labels = {p for _, p in _refusals(live)}
    assert not any(u in labels for u in unknown_prefixes)
    assert all(p == "unknown" or (p.startswith("sk-") and len(p) == 11) for p in labels), labels
    text = httpx.get(f"{live.base_url}/metrics", headers=_auth(live.extra["operator"])).text
    assert body not in text  # never the secret


def test_the_series_cap_sends_new_prefixes_to_other(live):
    """The counting script itself (gateway/auth.py ``_COUNT_LUA``) on the platform's Redis, with a cap of 2."""
    r = live.redis
    key = f"{live.prefix}:test:refusals"
    for field in ("revoked|sk-a", "revoked|sk-b", "revoked|sk-c", "revoked|sk-a"):
        r.eval(_COUNT_LUA, 1, key, field, "revoked|other", 2)
    assert {k.decode(): int(v) for k, v in r.hgetall(key).items()} == {"revoked|sk-a": 2, "revoked|sk-b": 1,
                                                                      "revoked|other": 1}
