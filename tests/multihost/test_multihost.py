"""The platform on several machines (issue 18): two api hosts (one the plain api process type, one a render-only
frontend machine running ``manage.py serve --no-engine``), a worker host (render, usage, beat), two engine hosts, a
Redis host and a PostgreSQL host, each a network namespace with its own address on a bridge this test makes
(``tests/support/multihost.py``); traffic goes only to those addresses. What must hold across hosts:

* admission is shared: with ``max_num_queued_reqs`` 3, a burst of 8 over both api hosts admits exactly 3 (a
  per-host count would admit 6);
* key limits are shared: a key of 3 requests per minute gets 3 answers and 3 refusals over both hosts;
* a key revoked through one api host's control API is refused by the other within 1 s;
* after ``kill -9`` of one engine host's engine and one api host mid-burst: no request hangs, every failure is clean,
  no admission reservation or key-limit lease is held 10 s later;
* exactly-once usage: every answered request (all tests) has exactly one usage record.

Skipped, with the reason, where network namespaces cannot be made (not root, no ``ip``) or Redis / PostgreSQL server
binaries are missing.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from inference.api import admission as adm
from harness.assets import DEMO_MODEL
from harness.drills import HANG_S, SETTLE_S, Outcome, send_chat
from tests.support.multihost import (ADMISSION_LIMIT, API_HOSTS, KEY_RPM, engines_paused, start_multihost,
                                     stop_multihost, unavailable)
from tests.support.live import stop_in_background

WHY = unavailable()
pytestmark = [pytest.mark.timeout(900)] + ([pytest.mark.skip(reason=f"many-hosts test: {WHY}")] if WHY else [])
ANSWERED: list[Outcome] = []  # every request that got an answer (a response or an error envelope), for usage
REVOKE_BOUND_S = 1.0


@pytest.fixture(scope="module")
def plat(tmp_path_factory):
    platform = start_multihost(tmp_path_factory.mktemp("multihost"))
    print(f"\nmany hosts ready: {platform.timings}")
    yield platform
    stop_in_background("many-hosts platform", lambda: stop_multihost(platform))


def _answered(outcomes: list[Outcome]) -> None:
    ANSWERED.extend(o for o in outcomes if o.kind in ("ok", "error"))


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_admission_limit_holds_across_api_hosts(plat):
    """Both engines paused: the admitted requests stay admitted, so exactly ``ADMISSION_LIMIT`` of 8 requests sent
    at once over both hosts are admitted, and the rest refused with 503 ``server_overloaded``."""
    n = 8

    async def burst() -> tuple[list[Outcome], tuple[int, int]]:
        async with httpx.AsyncClient(timeout=HANG_S) as http:
            with engines_paused(plat):
                tasks = [asyncio.create_task(send_chat(http, plat.base(API_HOSTS[i % 2]), plat.keys["main"],
                                                       f"mh-adm-{i}~", i, i % 2 == 0, 4, [])) for i in range(n)]
                deadline = time.monotonic() + 30
                while sum(t.done() for t in tasks) < n - ADMISSION_LIMIT and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                await asyncio.sleep(0.5)  # a late admission, were there one, would show here
                during = await asyncio.to_thread(plat.held)
                refused_early = sum(t.done() for t in tasks)
            outcomes = list(await asyncio.gather(*tasks))
        assert refused_early == n - ADMISSION_LIMIT, outcomes
        return outcomes, during

    try:
        outcomes, (queued_during, _slots) = asyncio.run(burst())
    finally:
        plat.manage("shell", "-c", "from admission.models import AdmissionPolicy; "
                                   "AdmissionPolicy.objects.all().delete()")
    _answered(outcomes)
    print("\n" + "\n".join(f"{o.client_id} {o.kind} {o.code}" for o in outcomes))
    assert queued_during == ADMISSION_LIMIT
    assert sum(o.kind == "ok" for o in outcomes) == ADMISSION_LIMIT, outcomes
    refused = [o for o in outcomes if o.kind != "ok"]
    assert len(refused) == n - ADMISSION_LIMIT and {(o.kind, o.code) for o in refused} == {
        ("error", "server_overloaded")}, outcomes
    r = plat.client()
    deadline = time.monotonic() + 15
    while adm.model_snapshot(r, plat.prefix, DEMO_MODEL)["max_num_queued_reqs"] is not None:
        assert time.monotonic() < deadline, "the admission policy's removal did not reach Redis"
        time.sleep(0.2)


def test_metrics_of_both_api_hosts_show_the_shared_queue(plat):
    """``/metrics`` (the HorizontalPodAutoscaler's source, deploy/k8s) answers the same admission gauges on both
    hosts: they come from the shared Redis."""
    values = []
    for host in API_HOSTS:
        r = httpx.get(f"{plat.base(host)}/metrics", headers=_auth(plat.keys["operator"]), timeout=20)
        assert r.status_code == 200, r.text
        m = re.search(rf'^admission_queued_requests\{{model="{re.escape(DEMO_MODEL)}"\}} (\S+)$', r.text, re.M)
        assert m, r.text[:2000]
        values.append(float(m.group(1)))
    assert values == [0.0, 0.0]


def test_key_rate_limit_holds_across_api_hosts(plat):
    """A key of ``KEY_RPM`` requests per minute, used through both hosts in turn: ``KEY_RPM`` answers, then 429s."""
    statuses = []
    for i in range(2 * KEY_RPM):
        r = httpx.post(f"{plat.base(API_HOSTS[i % 2])}/v1/chat/completions", timeout=30,
                       headers={**_auth(plat.keys["rpm"]), "X-Request-Id": f"mh-rpm-{i}~"},
                       json={"model": DEMO_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        statuses.append(r.status_code)
        if r.status_code == 200:
            ANSWERED.append(Outcome(f"mh-rpm-{i}~", False, "ok", 0.0))
    assert statuses == [200] * KEY_RPM + [429] * KEY_RPM


def test_key_revoked_through_one_api_host_is_refused_by_the_other(plat):
    """A key made and revoked through api1's ``/api/v1/keys``; api2, whose cache held it, refuses it within 1 s."""
    api1, api2 = (plat.base(h) for h in API_HOSTS)
    writer = _auth(plat.keys["writer"])
    r = httpx.post(f"{api1}/api/v1/keys", headers=writer, json={"name": "mh-revoke", "scopes": ["inference"]},
                   timeout=20)
    assert r.status_code == 201, r.text
    key = r.json()
    assert httpx.get(f"{api2}/v1/models", headers=_auth(key["key"]), timeout=20).status_code == 200
    r = httpx.delete(f"{api1}/api/v1/keys/{key['id']}", headers=writer, timeout=20)
    assert r.status_code == 200 and r.json()["status"] == "revoked", r.text
    done = time.monotonic()
    last_accepted = None  # start of the last request api2 still accepted, seconds after the revocation
    while True:
        started = time.monotonic() - done
        status = httpx.get(f"{api2}/v1/models", headers=_auth(key["key"]), timeout=20).status_code
        delay = time.monotonic() - done
        if status == 401:
            break
        assert status == 200 and delay < 5, (status, delay)
        last_accepted = started
    accepted = "never" if last_accepted is None else f"{last_accepted * 1000:.0f} ms"
    print(f"\nrevoked on api1; api2 last accepted the key (request start) at {accepted}, refused it by "
          f"{delay * 1000:.0f} ms")
    # the bound is on when api2 still said yes: the answer's own latency on a loaded machine is not part of it
    assert last_accepted is None or last_accepted <= REVOKE_BOUND_S


def test_engine_host_and_api_host_killed_mid_burst(plat):
    """16 chats over 2 s, alternately to each api host and streamed or not; 0.6 s in, ``kill -9`` of engine1's
    engine and of api1's process group. Nothing hangs, every failure is clean (api1's clients see their connection
    closed; api2's get answers or error envelopes), and 10 s later no reservation or key-limit lease is held and the
    live engine holds no sequence."""
    n, spread_s, kill_after_s = 16, 2.0, 0.6
    fault_at: list[float] = []

    async def burst() -> list[Outcome]:
        limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=httpx.Timeout(HANG_S), limits=limits) as http:
            async def later(i: int) -> Outcome:
                await asyncio.sleep(i * spread_s / n)
                return await send_chat(http, plat.base(API_HOSTS[i % 2]), plat.keys["main"], f"mh-kill-{i}~", i,
                                       (i // 2) % 2 == 0, 48, fault_at)

            tasks = [asyncio.create_task(later(i)) for i in range(n)]
            await asyncio.sleep(kill_after_s)
            fault_at.append(time.monotonic())
            plat.hosts["engine1"].kill("engine")
            plat.hosts["api1"].kill("api")
            return list(await asyncio.gather(*tasks))

    outcomes = asyncio.run(burst())
    ended = time.monotonic()
    time.sleep(max(0.0, max(fault_at[0], ended) + SETTLE_S - time.monotonic()))
    held, engine_load = plat.held(), plat.engine_load()
    _answered(outcomes)
    print("\n" + "\n".join(f"{o.client_id} {o.kind} {o.code} {o.seconds:.1f}s after_fault={o.after_fault}"
                           for o in outcomes))
    assert not [o for o in outcomes if o.kind in ("hung", "unclean")], outcomes
    via_api2 = outcomes[1::2]
    assert all(o.kind in ("ok", "error") for o in via_api2), via_api2  # api2 lived: every one answered
    assert any(o.kind == "ok" for o in via_api2), via_api2  # engine2 served
    assert held == (0, 0), f"held 10 s after the kill: {held[0]} reservations, {held[1]} key-limit leases"
    assert engine_load == 0, f"{engine_load} sequences still in the live engine 10 s after the burst"
    assert plat.serves("api2")


def test_every_answered_request_has_exactly_one_usage_record(plat):
    """Over all the tests above: each answered request one ``UsageRecord`` (lost: none; doubled: more than one).
    Requests cut off with api1 cannot have one and are not counted."""
    assert ANSWERED, "no request was answered"
    want = {o.client_id for o in ANSWERED}
    deadline = time.monotonic() + 60
    while True:
        counts = plat.usage_counts("mh-")
        if want <= set(counts) or time.monotonic() > deadline:
            break
        time.sleep(1)
    lost = sorted(cid for cid in want if counts.get(cid, 0) == 0)
    doubled = sorted(cid for cid, c in counts.items() if c > 1)
    print(f"\nusage: {len(want)} answered, {len(lost)} lost, {len(doubled)} doubled")
    assert (lost, doubled) == ([], [])
