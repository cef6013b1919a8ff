"""Tenant-fair admission through the API: two tenants' keys against the live admission platform (two api
processes, worker, engine, Redis; the package's fixture), and the request ``priority`` field's rule."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.admission.test_admission_live import MODEL, counters, in_background, set_limits, snap, wait_for
from tests.support.live import engine_paused

pytestmark = pytest.mark.timeout(600)  # run alone it starts the package platform: minutes on a loaded box


def _tenant(live, name: str, *opts: str) -> tuple[str, str]:
    """``(key secret, tenant id)`` of a new key of tenant ``name`` with the ``tenant_policy`` options."""
    out = live.manage("tenant_policy", name, *opts)
    tenant_id = re.search(r"id=(\d+)", out).group(1)
    return live.new_key(tenant=name), tenant_id


def _send(base: str, key: str, prompt_len: int = 20, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": [300 + i for i in range(prompt_len)], "max_tokens": 2, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=90)


def test_the_tenant_over_its_share_is_refused_and_the_other_finds_room(live):
    api1, api2 = live.base_url, live.extra["api2"]
    greedy, greedy_id = _tenant(live, "fair-greedy", "--fair-share-weight", "1")
    modest, modest_id = _tenant(live, "fair-modest", "--fair-share-weight", "1")
    live.manage("admission_policy", MODEL, "--fair-share-threshold-pct", "50")
    set_limits(live, reqs=6)
    try:
        background = []
        with engine_paused(live):
            for i in range(3):  # greedy alone: 3 = the soft threshold
                background.append(in_background(_send, api1 if i % 2 else api2, greedy))
            wait_for(lambda: counters(live)[0] == 3, 60, "greedy's three admitted")
            background.append(in_background(_send, api1, modest))
            wait_for(lambda: counters(live)[0] == 4, 60, "modest admitted")
            over = _send(api2, greedy)  # greedy holds 3 = its half of 6: refused though 2 slots are free
            for i in range(2):  # modest, within its share, gets them
                background.append(in_background(_send, api1 if i else api2, modest))
            try:
                wait_for(lambda: counters(live)[0] == 6, 60, "modest's share admitted")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {snap(live)}") from None
            full = _send(api1, modest)  # the hard limit still holds for everyone
        assert over.status_code == 503, over.text
        err = over.json()["error"]
        assert err["code"] == "server_overloaded" and "weighted share of 3" in err["message"], err
        assert int(over.headers["retry-after"]) >= 1
        assert full.status_code == 503 and "max_num_queued_reqs is 6" in full.json()["error"]["message"]
        for t, out in background:
            t.join(60)
            assert out["resp"].status_code == 200, out
        wait_for(lambda: counters(live) == (0, 0), 60, "release on finish")
        tenants = snap(live)["tenants"]
        # admitted counts takes: a reservation reaped while Redis stalled (a loaded box) and taken again counts twice
        assert tenants[greedy_id]["admitted"] >= 3 and tenants[greedy_id]["refused"] == 1
        assert tenants[modest_id]["admitted"] >= 3 and tenants[modest_id]["refused"] == 1
        assert tenants[greedy_id]["queued_reqs"] == 0 and tenants[greedy_id]["weight"] == 0

        metrics = httpx.get(f"{api1}/metrics", headers={"Authorization": f"Bearer {live.extra['operator_key']}"},
                            timeout=30).text
        assert f'admission_tenant_refused_total{{model="{MODEL}",tenant="{greedy_id}"}} 1.0' in metrics
        assert f'admission_tenant_refused_total{{model="{MODEL}",tenant="{modest_id}"}} 1.0' in metrics
        assert re.search(rf'admission_tenant_admitted_total{{model="{MODEL}",tenant="{modest_id}"}} [3-9]', metrics)
        assert f'admission_tenant_queued_prompt_tokens{{model="{MODEL}",tenant="{modest_id}"}} 0.0' in metrics
        assert re.search(rf'admission_rejections_total{{model="{MODEL}",reason="fair_share"}} [1-9]', metrics)

        # the request's priority can only lower it within the tier: a negative value is refused before any work
        bad = _send(api1, modest, priority=-1)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority", bad.text
        assert _send(api1, modest, priority=7).status_code == 200
    finally:
        live.manage("admission_policy", MODEL, "--fair-share-threshold-pct", "100")
        set_limits(live)
