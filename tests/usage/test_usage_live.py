"""Live: revocation in force in two api processes within 1 s; dashboards in headless Chromium.

Real processes (harness/live_platform.py): Redis, Celery worker + beat (usage flush + rollups), engine, uvicorn.
The browser is Debian's ``chromium`` driven by Playwright (never ``playwright install``). Predicates given to
``wait_for_function`` are functions (``"() => ..."``): a bare expression is re-evaluated with ``eval`` while
polling, which the pages' Content-Security-Policy (no 'unsafe-eval') refuses.
"""

from __future__ import annotations

import io
import json
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from harness.live_platform import free_port
from ops.supervisor import wait_until, http_ok as _http_ok

CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parents[2] / "var" / "test-screenshots"


def _chat(base: str, key: str, model: str, n: int, max_tokens: int = 4) -> list[int]:
    codes = []
    with httpx.Client(timeout=60) as http:
        for _ in range(n):
            r = http.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                          json={"model": model, "messages": [{"role": "user", "content": "hello there"}],
                                "max_tokens": max_tokens, "ignore_eos": True})
            codes.append(r.status_code)
    return codes


def _shell_json(live, code: str):
    return json.loads(live.manage("shell", "-c", code).strip().splitlines()[-1])


def test_revocation_and_changes_reach_both_api_processes_within_the_cache_ttl(live):
    _, base2 = live.start_api("api-rev")
    bases = [live.base_url, base2]
    admin = live.new_key(tenant=f"rev-{uuid.uuid4().hex[:6]}", scopes="inference,keys:write")
    made = httpx.post(live.base_url + "/api/v1/keys", headers={"Authorization": f"Bearer {admin}"},
                      json={"name": "victim"}, timeout=10)
    assert made.status_code == 201, made.text
    victim, victim_id = made.json()["key"], made.json()["id"]
    h = {"Authorization": f"Bearer {victim}"}
    with httpx.Client(timeout=10) as http:
        for base in bases:  # both processes have the key cached now
            assert http.get(base + "/v1/models", headers=h).status_code == 200
        r = http.delete(f"{base2}/api/v1/keys/{victim_id}", headers={"Authorization": f"Bearer {admin}"})
        assert r.status_code == 200 and r.json()["status"] == "revoked"
        # the revocation was committed before this answer; a process caches a verified key for at most
        # AUTH_CACHE_TTL_S: every request *sent* that long after this point is refused, however slow the machine
        from gateway.auth import AUTH_CACHE_TTL_S

        t0 = time.monotonic()
        refused_after_ttl: set[str] = set()
        late_200: list[tuple[str, float]] = []
        deadline = t0 + 60
        while time.monotonic() < deadline and refused_after_ttl != set(bases):
            for base in bases:
                sent = time.monotonic() - t0
                code = http.get(base + "/v1/models", headers=h).status_code
                if sent > AUTH_CACHE_TTL_S:
                    if code == 401:
                        refused_after_ttl.add(base)
                    else:
                        late_200.append((base, sent))
            time.sleep(0.02)
    assert refused_after_ttl == set(bases), refused_after_ttl
    assert not late_200, late_200


@pytest.fixture(scope="module")
def dash(live):
    """An api process serving the WebSocket routes too, a tenant owner user with a key, a staff user."""
    port = free_port()
    live.sup.start("api-ws", [sys.executable, "-m", "uvicorn", "tests.usage.asgi_ws:application", "--host",
                              "127.0.0.1", "--port", str(port), "--no-access-log"])
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: _http_ok(base + "/health"), 60, "api-ws /health", live.sup)
    tenant = f"dash-{uuid.uuid4().hex[:6]}"
    key = live.new_key(tenant=tenant, scopes="inference,usage:read")
    other_key = live.new_key(tenant=f"other-{uuid.uuid4().hex[:6]}")
    ids = _shell_json(live, (
        "import json; from django.contrib.auth import get_user_model; from tenancy.models import Tenant; "
        "U = get_user_model(); "
        f"u = U.objects.create_user('owner-{tenant}', password='pw-owner-123'); "
        f"t = Tenant.objects.get(name='{tenant}'); t.owner = u; t.save(); "
        f"s = U.objects.create_superuser('op-{tenant}', password='pw-op-123'); "
        "print(json.dumps({'tenant_id': t.pk}))"))
    return {"base": base, "tenant": tenant, "key": key, "other_key": other_key, "user": f"owner-{tenant}",
            "op": f"op-{tenant}", **ids}


def _db_totals(live, tenant_id: int | None) -> dict:
    flt = f"tenant_id={tenant_id}" if tenant_id is not None else ""
    return _shell_json(live, (
        "import json; from django.db.models import Sum, Count, Q; from usage.models import UsageRecord; "
        f"a = UsageRecord.objects.filter({flt}).aggregate(n=Count('id'), p=Sum('prompt_tokens'), "
        "c=Sum('completion_tokens'), s429=Count('id', filter=Q(status_code=429)), "
        "s503=Count('id', filter=Q(status_code=503))); print(json.dumps(a))"))


def _stream_state(live) -> str:
    import subprocess

    r = live.redis
    k = f"{live.prefix}:usage:events"
    try:
        pending = r.xpending(k, "usage-writers")
    except Exception as exc:  # noqa: BLE001
        pending = repr(exc)
    active = subprocess.run([sys.executable, "-m", "celery", "-A", "config", "inspect", "active", "-t", "3"],
                            env=live.env, cwd=str(Path(__file__).resolve().parents[2]), capture_output=True,
                            text=True, timeout=60).stdout[-1500:]
    return f"xlen={r.xlen(k)} pending={pending} active={active}"


def _wait_rolled(base: str, key: str, want: int, timeout: float = 60.0, live=None) -> dict:
    data: dict = {}

    def ok():
        nonlocal data
        r = httpx.get(base + "/api/v1/usage", params={"range": "hour"}, headers={"Authorization": f"Bearer {key}"},
                      timeout=10)
        data = r.json()
        return r.status_code == 200 and data["totals"]["requests"] >= want

    try:
        wait_until(ok, timeout, f"{want} requests rolled up")
    except RuntimeError as exc:
        state = _stream_state(live) if live is not None else ""
        raise AssertionError(f"{exc}; last totals {data.get('totals')}; {state}") from None
    return data


def _drawn_pixels(png: bytes, rgb: tuple[int, int, int], tol: int = 12) -> int:
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    pixels = img.get_flattened_data() if hasattr(img, "get_flattened_data") else img.getdata()  # Pillow >= 12.1
    return sum(1 for px in pixels if all(abs(a - b) <= tol for a, b in zip(px, rgb)))


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium missing (apt-get install chromium)")
def test_dashboards_in_chromium_match_the_database_and_update_live(live, dash, model_name):
    from playwright.sync_api import sync_playwright

    base = dash["base"]
    codes = _chat(base, dash["key"], model_name, 6)
    assert codes == [200] * 6
    bad = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {dash['key']}"}, timeout=30,
                     json={"model": model_name, "messages": [{"role": "user", "content": "x"}],
                           "max_tokens": live.max_model_len})
    assert bad.status_code == 400
    assert _chat(base, dash["other_key"], model_name, 2) == [200, 200]  # another tenant's traffic
    _wait_rolled(base, dash["key"], 7, live=live)
    db = _db_totals(live, dash["tenant_id"])
    assert db["n"] == 7
    SHOTS.mkdir(parents=True, exist_ok=True)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(base + "/usage/?range=hour")
            assert "/accounts/login/" in page.url  # login required
            page.fill("input[name=username]", dash["user"])
            page.fill("input[name=password]", "pw-owner-123")
            page.click("#login-submit")
            page.wait_for_url("**/usage/**")
            page.wait_for_function("() => window.usageDashboard && window.usageDashboard.data")
            figs = {f: page.inner_text(f"#fig-{f}") for f in ("requests", "prompt_tokens", "completion_tokens",
                                                             "status_429", "status_503")}
            assert figs == {"requests": str(db["n"]), "prompt_tokens": str(db["p"]),
                            "completion_tokens": str(db["c"]), "status_429": str(db["s429"]),
                            "status_503": str(db["s503"])}
            assert page.inner_text("#fig-error_rate") == f"{100 / 7:.2f} %"  # the one 400 of 7
            assert page.locator("#usage-keys tbody tr").count() == 1  # only this tenant's key
            assert float(page.inner_text("#fig-ttft_p50_ms")) > 0
            # the WebSocket is connected, and new traffic reaches the page without a reload
            page.wait_for_function("() => document.getElementById('usage-live').textContent === 'live'",
                                   timeout=15_000)
            assert _chat(base, dash["key"], model_name, 3) == [200] * 3
            page.wait_for_function("() => window.usageDashboard.updates > 0 && "
                                   "window.usageDashboard.data.totals.requests === 10", timeout=30_000)
            db = _db_totals(live, dash["tenant_id"])
            assert page.inner_text("#fig-requests") == str(db["n"]) == "10"
            assert page.inner_text("#fig-completion_tokens") == str(db["c"])
            shot = page.locator("#chart-requests").screenshot(path=str(SHOTS / "tenant-requests-chart.png"))
            page.screenshot(path=str(SHOTS / "tenant-dashboard.png"), full_page=True)
            assert _drawn_pixels(shot, (0x4e, 0x79, 0xa7)) > 50  # the "ok" bars are drawn
            lat = page.locator("#chart-latency").screenshot()
            assert _drawn_pixels(lat, (0x4e, 0x79, 0xa7)) + _drawn_pixels(lat, (0xe1, 0x57, 0x59)) > 20

            # operator page inside the admin: all tenants
            op = browser.new_page(viewport={"width": 1400, "height": 1000})
            op.goto(base + "/admin/login/?next=/admin/usage/usagerollup/")
            op.fill("input[name=username]", dash["op"])
            op.fill("input[name=password]", "pw-op-123")
            op.click("input[type=submit]")
            op.wait_for_url("**/admin/usage/usagerollup/**")
            op.wait_for_function("() => window.usageDashboard && window.usageDashboard.data")
            everyone = _db_totals(live, None)
            assert op.inner_text("#fig-requests") == str(everyone["n"])
            assert op.inner_text("#fig-prompt_tokens") == str(everyone["p"])
            assert op.locator("#usage-keys tbody tr").count() >= 2
            op.screenshot(path=str(SHOTS / "operator-dashboard.png"), full_page=True)
        finally:
            browser.close()
