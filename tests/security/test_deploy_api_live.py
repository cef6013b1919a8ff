"""Issue 39, items 1 and 3, against the api as ``deploy/k8s/api.yaml`` starts it (its uvicorn command, the
ConfigMap's environment: behind a TLS-terminating proxy), with the test as the proxy on loopback
(``FORWARDED_ALLOW_IPS=127.0.0.1``, ``X-Forwarded-Proto: https``, ``Host`` the ConfigMap's allowed host):

* django-axes counts failed logins per real client (``X-Forwarded-For``, as the proxy appends it): one client's
  failures lock that client out, not every client; a client cannot pick the address by sending its own
  ``X-Forwarded-For`` (the proxy appends the real one, which uvicorn takes).
* The audit log names the real client of a change.
* ``/v1/models`` needs the ``inference`` scope like the other inference routes: a ``metrics`` key gets the same
  403 envelope as on ``/v1/chat/completions``.

Issue 39's follow-up, the api as each deploy form starts it (``Procfile``, the systemd unit, the Dockerfile's
``CMD``, compose's ``api`` service, k8s's ``api`` container; its command expanded as that tool expands it, its
environment the image's or unit's own under the operator's), on loopback:

* not behind a proxy (``FORWARDED_ALLOW_IPS`` unset) it believes no ``X-Forwarded-For``, not even from loopback
  (uvicorn's own default trusts 127.0.0.1, so a loopback sidecar could pick any address): five failed logins from
  one client lock it out whatever ``X-Forwarded-For`` it sends, as through ``manage.py serve``;
* behind one it believes exactly the listed proxies: a listed loopback address (127.0.0.2) is believed, 127.0.0.1
  (not listed) is not.

No engine or Celery worker: everything under test is answered by the api process itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from ops.supervisor import Supervisor, wait_until, http_ok as _http_ok
from harness import REPO
from harness.live_platform import child_env, free_port, redis_for, run_manage, stop_children

PASSWORD = "pw-right-" + "x7q2"
HOST = "api.example.com"
DEPLOY = REPO / "deploy"
#: the api's deploy forms, each tried with its own command and environment (``_form_api``)
FORMS = ("procfile", "systemd", "dockerfile", "compose", "k8s")
#: one login name per form and case: django-axes locks a (username, client address) pair out
FORM_USERS = tuple(f"{case}-{form}" for form in FORMS for case in ("direct", "proxied"))
_SETUP = f"""
FORM_USERS = {FORM_USERS!r}
import json
from django.contrib.auth import get_user_model
from tenancy.models import Tenant
from tenancy.services import api_key_create
U = get_user_model()
for name in ("alice", "bob", "carol", *FORM_USERS):
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
def deployment(tmp_path_factory):
    """Redis and a migrated database with the test's users and keys; ``env``: the environment every api of the
    module shares (no proxy setting), ``var_dir``, ``keys``."""
    var_dir, prefix, env, scratch = child_env(tmp_path_factory.mktemp("deployapi"), "dapi")
    for name in ("FORWARDED_ALLOW_IPS", "DJANGO_BEHIND_TLS_PROXY", "DJANGO_SECURE"):
        env.pop(name, None)
    env["DJANGO_ALLOWED_HOSTS"] = HOST
    sup = Supervisor(env=env, log_dir=var_dir / "log")
    try:
        redis_for(sup, env, var_dir)
        run_manage(env, "migrate", "--no-input", timeout=300)
        keys = json.loads(run_manage(env, "shell", "-c", _SETUP).strip().splitlines()[-1])
        yield {"env": env, "var_dir": var_dir, "keys": keys}
    finally:
        stop_children(sup, scratch, env.get("REDIS_URL", ""), prefix)


@pytest.fixture(scope="module")
def site(deployment):
    command, config = _k8s_api()
    assert config["DJANGO_BEHIND_TLS_PROXY"] == "1" and HOST in config["DJANGO_ALLOWED_HOSTS"].split(",")
    env = dict(deployment["env"])
    config.update({"LINK_PREFIX": env["LINK_PREFIX"], "FORWARDED_ALLOW_IPS": "127.0.0.1"})  # the test is the proxy
    env.update(config)
    sup = Supervisor(env=env, log_dir=deployment["var_dir"] / "log")
    try:
        port = free_port()
        argv = [sys.executable, *command[1:]]
        argv[argv.index("--host") + 1], argv[argv.index("--port") + 1] = "127.0.0.1", str(port)
        argv = [_k8s_expand(a, env) for a in argv]  # as Kubernetes expands it
        sup.start("api", argv)
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _http_ok(base + "/health"), 90, "api /health", sup)
        yield {"base": base, "env": env, "keys": deployment["keys"]}
    finally:
        sup.stop_all()


def _proxied(client_addr: str, **extra: str) -> dict[str, str]:
    """Headers the TLS proxy sends for a client at ``client_addr`` (``X-Forwarded-For`` as it ends up: what the
    client sent, if anything, then the address the proxy saw)."""
    return {"Host": HOST, "X-Forwarded-Proto": "https", "X-Forwarded-For": client_addr, **extra}


def _login(base: str, username: str, password: str, client_addr: str, path: str = "/accounts/login/",
           local_address: str = "127.0.0.1") -> int:
    """One login through the form, as a browser behind the proxy (CSRF cookie and token from a GET; the cookie is
    ``Secure``, so it is sent by hand over the test's plain-HTTP hop), connecting from ``local_address``; the
    status."""
    with httpx.Client(base_url=base, timeout=60,
                      transport=httpx.HTTPTransport(local_address=local_address)) as client:
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


# ------------------------------------------------------------------------------------------------ every deploy form
def _dockerfile_env() -> dict[str, str]:
    """The image's ``ENV`` (deploy/Dockerfile): what every container starts with, under its own environment."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(word.split("=", 1) for word in shlex.split(line[4:]))
    return env


def _dockerfile_cmd() -> list[str]:
    """The image's ``CMD`` (exec form, a JSON list)."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    return json.loads(next(ln for ln in text.splitlines() if ln.startswith("CMD "))[4:])


def _k8s_expand(word: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a container's command: ``$(VAR)`` is the container's variable, left as written
    when it has none; ``$$`` is a ``$``."""
    return re.sub(r"\$\$|\$\((\w+)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), word)


def _systemd_expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """systemd's expansion of ``ExecStart``: ``${VAR}`` is the value as it is (one word, empty when unset),
    a lone ``$VAR`` word is the value split at whitespace."""
    out: list[str] = []
    for word in argv:
        if re.fullmatch(r"\$\w+", word):
            out += env.get(word[1:], "").split()
        else:
            out.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
    return out


def _on_loopback(argv: list[str], port: int) -> list[str]:
    """``argv`` listening on 127.0.0.1:``port`` with one worker (the deploy forms listen on 0.0.0.0:8000)."""
    argv = list(argv)
    for option, value in (("--host", "127.0.0.1"), ("--port", str(port)), ("--workers", "1")):
        argv[argv.index(option) + 1] = value
    return argv


def _script_on_loopback(script: str, port: int) -> str:
    return re.sub(r"--workers \S+", "--workers 1",
                  re.sub(r"--port \S+", f"--port {port}", re.sub(r"--host \S+", "--host 127.0.0.1", script)))


def _form_api(form: str, operator_env: dict[str, str], port: int) -> tuple[list[str], dict[str, str]]:
    """The api's command and environment as deploy form ``form`` starts it, listening on 127.0.0.1:``port``
    (with one worker), in this checkout (its ``/opt/llmp``); ``operator_env``: the environment the operator gives
    it (``/etc/llmp/env``, ``docker run -e``/compose's ``environment``, the ConfigMap and Secret)."""
    cd = f"cd {shlex.quote(str(REPO))} && "
    if form == "procfile":  # a Procfile runner runs the line with sh
        line = next(ln for ln in (DEPLOY / "Procfile").read_text().splitlines() if ln.startswith("api:"))
        return ["sh", "-c", cd + _script_on_loopback(line.split(":", 1)[1].strip(), port)], dict(operator_env)
    if form == "systemd":  # Environment= first, EnvironmentFile= (the operator's) over it
        unit = (DEPLOY / "systemd" / "llmp-api.service").read_text().splitlines()
        env = dict(ln.split("=", 1)[1].split("=", 1) for ln in unit if ln.startswith("Environment="))
        env.update(operator_env)
        argv = _systemd_expand(shlex.split(next(ln for ln in unit if ln.startswith("ExecStart="))[10:]), env)
        assert argv[0] == "/opt/llmp/.venv/bin/python", argv
        return ["sh", "-c", cd + "exec " + shlex.join(_on_loopback([sys.executable, *argv[1:]], port))], env
    env = {**_dockerfile_env(), **operator_env}  # the image's ENV under the container's own environment
    if form == "dockerfile":
        argv = _dockerfile_cmd()
    elif form == "compose":  # compose unescapes $$ (its own interpolation) before the container runs it
        argv = [a.replace("$$", "$") for a in yaml.safe_load((DEPLOY / "compose.yaml").read_text())
                ["services"]["api"]["command"]]
    else:
        argv = [_k8s_expand(a, env) for a in _k8s_api()[0]]
    if argv[:2] == ["sh", "-c"]:
        return ["sh", "-c", cd + _script_on_loopback(argv[2], port)], env
    return ["sh", "-c", cd + "exec " + shlex.join(_on_loopback(argv, port))], env


@contextlib.contextmanager
def _started(deployment, form: str, proxy_env: dict[str, str]) -> Iterator[str]:
    """The api of deploy form ``form`` running with the deployment's environment plus ``proxy_env``; its base URL.
    ``python`` is this environment's."""
    operator_env = {**deployment["env"], **proxy_env}
    operator_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), operator_env.get("PATH", "")])
    port = free_port()
    argv, env = _form_api(form, operator_env, port)
    sup = Supervisor(env=env, log_dir=deployment["var_dir"] / "log" / form)
    try:
        sup.start("api", argv)
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _http_ok(base + "/health"), 90, f"the {form} api's /health", sup)
        yield base
    finally:
        sup.stop_all()


def _attempt_addresses(deployment, username: str) -> list[str]:
    code = ("import json; from axes.models import AccessAttempt; print(json.dumps(sorted(set(AccessAttempt.objects"
            f".filter(username={username!r}).values_list('ip_address', flat=True)))))")
    return json.loads(run_manage(deployment["env"], "shell", "-c", code).strip().splitlines()[-1])


@pytest.mark.parametrize("form", FORMS)
def test_api_not_behind_a_proxy_believes_no_forwarded_header(deployment, form):
    """The finding: plain ``python -m uvicorn`` believes ``X-Forwarded-For`` from 127.0.0.1 (uvicorn's default
    trust), so failed logins with a new address each time were never locked out; ``serve`` passes
    ``--no-proxy-headers`` and locked at the 5th."""
    user = f"direct-{form}"
    with _started(deployment, form, {}) as base:
        statuses = [_login(base, user, "wrong", f"9.9.9.{i}") for i in range(5)]
    assert statuses == [200, 200, 200, 200, 429], statuses
    assert _attempt_addresses(deployment, user) == ["127.0.0.1"]


@pytest.mark.parametrize("form", FORMS)
def test_api_behind_a_proxy_believes_exactly_the_listed_proxies(deployment, form):
    user = f"proxied-{form}"
    with _started(deployment, form, {"DJANGO_BEHIND_TLS_PROXY": "1", "FORWARDED_ALLOW_IPS": "127.0.0.2"}) as base:
        assert _login(base, user, "wrong", "203.0.113.21", local_address="127.0.0.2") == 200
        assert _attempt_addresses(deployment, user) == ["203.0.113.21"]  # the listed proxy is believed
        assert _login(base, user, "wrong", "203.0.113.22", local_address="127.0.0.1") == 200
    assert _attempt_addresses(deployment, user) == ["127.0.0.1", "203.0.113.21"]  # 127.0.0.1 is not listed
