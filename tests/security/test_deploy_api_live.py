"""Issue 39, items 1 and 3, against the api as ``deploy/k8s/api.yaml`` starts it (its uvicorn command, the
ConfigMap's environment: behind a TLS-terminating proxy), with the test as the proxy on loopback
(``FORWARDED_ALLOW_IPS=127.0.0.1``, ``X-Forwarded-Proto: https``, ``Host`` the ConfigMap's allowed host):

* django-axes counts failed logins per real client (``X-Forwarded-For``, as the proxy appends it): one client's
  failures lock that client out, not every client; a client cannot pick the address by sending its own
  ``X-Forwarded-For`` (the proxy appends the real one, which uvicorn takes).
* The audit log names the real client of a change.
* ``/v1/models`` needs the ``inference`` scope like the other inference routes: a ``metrics`` key gets the same
  403 envelope as on ``/v1/chat/completions``.

No engine or Celery worker: everything under test is answered by the api process itself.
"""

from __future__ import annotations

import json
import re
import sys

import httpx
import pytest
import yaml

from ops.supervisor import Supervisor, wait_until
from tests.live_platform import REPO, _http_ok, child_env, free_port, redis_for, run_manage, stop_children

PASSWORD = "pw-right-" + "x7q2"
HOST = "api.example.com"
_SETUP = f"""
import json
from django.contrib.auth import get_user_model
from tenancy.models import Tenant
from tenancy.services import api_key_create
U = get_user_model()
for name in ("alice", "bob", "carol"):
    U.objects.create_superuser(name, password={PASSWORD!r})
tenant = Tenant.objects.create(name="acme")
keys = {{scope: api_key_create(tenant=tenant, name=scope.replace(":", "-"), scopes=[scope])[1]
        for scope in ("metrics", "inference")}}
keys["writer"] = api_key_create(tenant=tenant, name="writer", scopes=["inference", "keys:write"])[1]
print(json.dumps(keys))
"""


def _k8s_api() -> tuple[list[str], dict[str, str]]:
    """The api container's command (``python -m uvicorn ...``) and the ConfigMap's environment."""
    api = yaml.safe_load((REPO / "deploy" / "k8s" / "api.yaml").read_text().split("\n---\n")[0])
    config = yaml.safe_load((REPO / "deploy" / "k8s" / "config.yaml").read_text())["data"]
    return list(api["spec"]["template"]["spec"]["containers"][0]["command"]), dict(config)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    var_dir, prefix, env, scratch = child_env(tmp_path_factory.mktemp("deployapi"), "dapi")
    command, config = _k8s_api()
    assert config["DJANGO_BEHIND_TLS_PROXY"] == "1" and HOST in config["DJANGO_ALLOWED_HOSTS"].split(",")
    config.update({"LINK_PREFIX": prefix, "FORWARDED_ALLOW_IPS": "127.0.0.1"})  # the test is the proxy
    env.update(config)
    sup = Supervisor(env=env, log_dir=var_dir / "log")
    try:
        redis_for(sup, env, var_dir)
        run_manage(env, "migrate", "--no-input", timeout=300)
        keys = json.loads(run_manage(env, "shell", "-c", _SETUP).strip().splitlines()[-1])
        port = free_port()
        argv = [sys.executable, *command[1:]]
        argv[argv.index("--host") + 1], argv[argv.index("--port") + 1] = "127.0.0.1", str(port)
        sup.start("api", argv)
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _http_ok(base + "/health"), 90, "api /health", sup)
        yield {"base": base, "env": env, "keys": keys}
    finally:
        stop_children(sup, scratch, env.get("REDIS_URL", ""), prefix)


def _proxied(client_addr: str, **extra: str) -> dict[str, str]:
    """Headers the TLS proxy sends for a client at ``client_addr`` (``X-Forwarded-For`` as it ends up: what the
    client sent, if anything, then the address the proxy saw)."""
    return {"Host": HOST, "X-Forwarded-Proto": "https", "X-Forwarded-For": client_addr, **extra}


def _login(base: str, username: str, password: str, client_addr: str, path: str = "/accounts/login/") -> int:
    """One login through the form, as a browser behind the proxy (CSRF cookie and token from a GET; the cookie is
    ``Secure``, so it is sent by hand over the test's plain-HTTP hop); the status."""
    with httpx.Client(base_url=base, timeout=60) as client:
        page = client.get(path, headers=_proxied(client_addr))
        assert page.status_code == 200, page.text[:500]
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
        cookie = next(re.match(r"csrftoken=([^;]+)", h).group(1) for h in page.headers.get_list("set-cookie")
                      if h.startswith("csrftoken="))
        r = client.post(path, data={"username": username, "password": password, "csrfmiddlewaretoken": token},
                        headers=_proxied(client_addr, Referer=f"https://{HOST}{path}", Cookie=f"csrftoken={cookie}"))
        return r.status_code


def _shell(site, code: str):
    return json.loads(run_manage(site["env"], "shell", "-c", code).strip().splitlines()[-1])


def test_one_clients_failed_logins_lock_out_that_client_only(site):
    statuses = [_login(site["base"], "alice", "wrong", "203.0.113.7") for _ in range(5)]
    assert statuses == [200, 200, 200, 200, 429], statuses
    assert _login(site["base"], "alice", PASSWORD, "203.0.113.7") == 429  # locked out, right password or not
    assert _login(site["base"], "alice", PASSWORD, "198.51.100.9") == 302  # another client is not
    seen = _shell(site, "import json; from axes.models import AccessAttempt; print(json.dumps(sorted(set("
                        "AccessAttempt.objects.filter(username='alice').values_list('ip_address', flat=True)))))")
    assert seen == ["203.0.113.7"]


def test_a_client_cannot_choose_its_address_with_its_own_x_forwarded_for(site):
    # the client sends a different X-Forwarded-For each time; the proxy appends the address it saw
    statuses = [_login(site["base"], "bob", "wrong", f"9.9.9.{i}, 203.0.113.8") for i in range(5)]
    assert statuses[-1] == 429, statuses
    assert _login(site["base"], "bob", PASSWORD, "9.9.9.99, 203.0.113.8") == 429
    assert _login(site["base"], "bob", PASSWORD, "198.51.100.10") == 302


def test_the_audit_log_names_the_real_client(site):
    r = httpx.post(site["base"] + "/api/v1/keys", json={"name": "from-proxy"}, timeout=60,
                   headers=_proxied("203.0.113.50", Authorization=f"Bearer {site['keys']['writer']}"))
    assert r.status_code == 201, r.text
    entry = _shell(site, "import json; from auditlog.models import LogEntry; e = LogEntry.objects.order_by('-pk')"
                         ".first(); print(json.dumps([e.remote_addr, e.changes]))")
    assert entry[0] == "203.0.113.50" and "from-proxy" in json.dumps(entry[1]), entry


def _get(site, path: str, key: str) -> httpx.Response:
    return httpx.get(site["base"] + path, headers=_proxied("203.0.113.60", Authorization=f"Bearer {key}"),
                     timeout=60)


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/tiny-qwen3"])
def test_models_needs_the_inference_scope(site, path):
    r = _get(site, path, site["keys"]["metrics"])
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    chat = httpx.post(site["base"] + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}]},
                      headers=_proxied("203.0.113.60", Authorization=f"Bearer {site['keys']['metrics']}"))
    assert chat.status_code == 403
    assert err == chat.json()["error"]  # the same envelope as the other inference routes
    assert err["type"] == "permission_error" and "'inference' scope" in err["message"]


def test_models_still_answers_an_inference_key(site):
    r = _get(site, "/v1/models", site["keys"]["inference"])
    assert r.status_code == 200 and r.json()["object"] == "list", r.text
