"""Issue 39, items 1 and 5: configurations the platform refuses to start with, tried through the real start
commands (the api's uvicorn as ``deploy/`` runs it, ``manage.py serve``, a Celery worker, ``manage.py migrate``,
``manage.py check --deploy``).

* Behind a TLS-terminating proxy (``DJANGO_BEHIND_TLS_PROXY``) without ``FORWARDED_ALLOW_IPS`` every client would
  have the proxy's address (one client's failed logins lock every client out; the audit log names the proxy): the
  api refuses to start, saying what to set. Other processes are not concerned (they serve no client).
* An example secret of ``deploy/`` (``CHANGE_ME...``) still in the environment: every Django process refuses to
  start (DEBUG off), naming each variable. The quickstart's defaults (secrets generated under ``var/``) still start.

No test reaches a Redis or database: their URLs point at a closed loopback port, and a refused process stops before
it connects (one that does not refuse is stopped at the time limit and fails the test).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import yaml

from harness.live_platform import free_port

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
START_TIMEOUT_S = 60  # a process that refuses exits within seconds; one that starts is stopped here
UVICORN_STARTUP_FAILURE = 3  # uvicorn's exit status for an app that cannot load (its worker supervisor stops too)
_CLEARED = ("DATABASE_URL", "REDIS_URL", "DJANGO_SECRET_KEY", "SECRET_KEY", "API_KEY_PEPPER", "DJANGO_DEBUG",
            "DEBUG", "DJANGO_BEHIND_TLS_PROXY", "DJANGO_SECURE", "FORWARDED_ALLOW_IPS", "SEGMENT_CACHE_REDIS_URL",
            "DJANGO_ALLOWED_HOSTS", "LINK_PREFIX")


# ------------------------------------------------------------------------------------------------ helpers
def _base_env(tmp_path: Path) -> dict[str, str]:
    """This process's environment without any deployment setting, a fresh ``var/`` and nothing listening where
    the embedded Redis would be."""
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)]),
                "DJANGO_SETTINGS_MODULE": "config.settings", "LLMP_VAR_DIR": str(tmp_path / "var"),
                "LOG_LEVEL": "WARNING", "EMBEDDED_REDIS_PORT": str(free_port()),
                "LINK_PREFIX": f"dsr{uuid.uuid4().hex[:8]}"})
    return env


def _to_loopback(url: str, port: int) -> str:
    """``url`` with its host replaced by 127.0.0.1:``port`` (its user and password kept)."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{userinfo + '@' if userinfo else ''}127.0.0.1:{port}"))


def _safe(env: dict[str, str]) -> dict[str, str]:
    """``env`` with every ``CHANGE_ME...`` example value replaced by a random one."""
    return {k: re.sub(r"CHANGE_ME\w*", lambda _m: uuid.uuid4().hex + uuid.uuid4().hex, v) for k, v in env.items()}


def _env_example() -> dict[str, str]:
    """``deploy/env.example`` (copied to /etc/llmp/env by the systemd units)."""
    return dict(ln.split("=", 1) for ln in (DEPLOY / "env.example").read_text().splitlines()
                if ln and not ln.startswith("#"))


def _compose_example() -> dict[str, str]:
    """The environment ``deploy/compose.yaml`` gives its app services from ``compose.env.example``."""
    values = dict(ln.split("=", 1) for ln in (DEPLOY / "compose.env.example").read_text().splitlines()
                  if ln and not ln.startswith("#"))
    env = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["x-app"]["environment"]

    def sub(value: str) -> str:
        return re.sub(r"\$\{(\w+)(?::[-?]([^}]*))?\}", lambda m: values.get(m.group(1), m.group(2) or ""), value)

    return {k: sub(str(v)) for k, v in env.items()}


def _k8s_example() -> dict[str, str]:
    """The environment ``deploy/k8s`` gives its pods: the ConfigMap ``llmp-config`` and the Secret ``llmp-secrets``."""
    env: dict[str, str] = {}
    for name in ("config.yaml", "secret.yaml"):
        doc = yaml.safe_load((DEPLOY / "k8s" / name).read_text())
        env.update(doc.get("data") or doc.get("stringData"))
    return env


EXAMPLES = {"env.example": _env_example, "compose": _compose_example, "k8s": _k8s_example}


def _deployment_env(tmp_path: Path, example: dict[str, str]) -> dict[str, str]:
    """``example`` over the base environment, with Redis and PostgreSQL moved to closed loopback ports and the
    allowed hosts the test's."""
    env = _base_env(tmp_path)
    env.update(example)
    for name in ("REDIS_URL", "DATABASE_URL"):
        if name in env:
            env[name] = _to_loopback(env[name], free_port())
    env["DJANGO_ALLOWED_HOSTS"] = "127.0.0.1,localhost"
    return env


def _run(argv: list[str], env: dict[str, str]) -> tuple[int | None, str]:
    """Run ``argv`` until it exits (at most ``START_TIMEOUT_S``); ``(exit status, stdout + stderr)``, status None
    when it was still running (then its whole process group is killed)."""
    proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=START_TIMEOUT_S)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


def _api_argv(env: dict[str, str], workers: int = 1) -> list[str]:
    """The api's command of deploy/k8s/api.yaml (the systemd unit's with ``workers`` 2), on a loopback port, its
    ``$(VAR)`` expanded from ``env`` as Kubernetes does (left as written where ``env`` has no such variable)."""
    container = yaml.safe_load((DEPLOY / "k8s" / "api.yaml").read_text().split("\n---\n")[0])
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a)
            for a in container["spec"]["template"]["spec"]["containers"][0]["command"]]
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[argv.index("--port") + 1] = str(free_port())
    argv[argv.index("--workers") + 1] = str(workers)
    assert argv[:3] == ["python", "-m", "uvicorn"]
    return [sys.executable, *argv[1:]]


def _render_worker_argv() -> list[str]:
    """The render worker of deploy/Procfile (its variable assignments dropped)."""
    line = next(ln for ln in (DEPLOY / "Procfile").read_text().splitlines() if ln.startswith("worker:"))
    argv = line.split(":", 1)[1].split()
    while "=" in argv[0]:
        argv.pop(0)
    assert argv[0] == "celery"
    return [sys.executable, "-m", *argv]


def _manage(*args: str) -> list[str]:
    return [sys.executable, "manage.py", *args]


# ------------------------------------------------------------------------------------------------ item 5
def _example_names(example: dict[str, str]) -> set[str]:
    return {k for k, v in example.items() if "CHANGE_ME" in v}


@pytest.mark.parametrize("source", sorted(EXAMPLES))
def test_api_refuses_the_example_secrets(tmp_path, source):
    example = EXAMPLES[source]()
    names = _example_names(example)
    assert {"DJANGO_SECRET_KEY", "REDIS_URL", "DATABASE_URL", "API_KEY_PEPPER"} <= names, names
    env = _deployment_env(tmp_path, _safe(example) | {k: example[k] for k in names})
    env["FORWARDED_ALLOW_IPS"] = "10.244.3.0/24"  # k8s is behind a TLS proxy: not what this test is about
    status, out = _run(_api_argv(env), env)
    assert status == UVICORN_STARTUP_FAILURE, (status, out[-3000:])
    for name in names:
        assert name in out, (name, out[-3000:])
    assert "CHANGE_ME" in out


@pytest.mark.parametrize("argv", [_render_worker_argv(), _manage("migrate", "--no-input"), _manage("serve")],
                         ids=["celery-worker", "migrate", "serve"])
def test_other_processes_refuse_the_example_secrets(tmp_path, argv):
    example = _env_example()
    env = _deployment_env(tmp_path, example)
    status, out = _run(argv, env)
    assert status not in (None, 0), out[-3000:]
    last = out.rstrip().splitlines()[-1]  # the message ends the output (after Django's traceback, if any)
    for name in _example_names(example):
        assert name in last, (name, out[-3000:])
    assert "CHANGE_ME" in last


def test_one_example_secret_is_enough_to_refuse(tmp_path):
    example = _safe(_env_example())
    example["API_KEY_PEPPER"] = "CHANGE_ME_long_random"
    status, out = _run(_manage("check"), _deployment_env(tmp_path, example))
    assert status not in (None, 0) and "API_KEY_PEPPER" in out, out[-3000:]
    for other in ("DJANGO_SECRET_KEY", "REDIS_URL", "DATABASE_URL"):
        assert f"{other} " not in out.rsplit("API_KEY_PEPPER", 1)[-1][:200]


def test_real_secrets_and_the_quickstart_defaults_start(tmp_path):
    # the deployment's variables with secrets of its own
    status, out = _run(_manage("check"), _deployment_env(tmp_path, _safe(_env_example())))
    assert status == 0, out[-3000:]
    # the quickstart: no secret in the environment, generated once under var/
    env = _base_env(tmp_path)
    status, out = _run(_manage("check"), env)
    assert status == 0, out[-3000:]
    assert (tmp_path / "var" / "secret_key").is_file() and (tmp_path / "var" / "redis_password").is_file()


def test_debug_allows_the_example_secrets(tmp_path):
    env = _deployment_env(tmp_path, _env_example())
    env["DJANGO_DEBUG"] = "1"
    status, out = _run(_manage("check"), env)
    assert status == 0, out[-3000:]


# ------------------------------------------------------------------------------------------------ item 1
def _behind_proxy_env(tmp_path: Path) -> dict[str, str]:
    """The k8s deployment's environment (behind the Ingress's TLS) with its own secrets, no FORWARDED_ALLOW_IPS."""
    env = _deployment_env(tmp_path, _safe(_k8s_example()))
    env.pop("FORWARDED_ALLOW_IPS", None)
    assert env["DJANGO_BEHIND_TLS_PROXY"] == "1"
    return env


def _says_what_to_set(out: str) -> bool:
    return "FORWARDED_ALLOW_IPS" in out and "DJANGO_BEHIND_TLS_PROXY" in out


@pytest.mark.parametrize("workers", [1, 2])
def test_api_behind_a_tls_proxy_refuses_to_start_without_trusted_proxies(tmp_path, workers):
    env = _behind_proxy_env(tmp_path)
    status, out = _run(_api_argv(env, workers), env)
    assert status is not None, "the api started: " + out[-3000:]
    if workers == 1:
        assert status == UVICORN_STARTUP_FAILURE, (status, out[-3000:])
    else:  # uvicorn's supervisor stops (instead of restarting its workers forever) once a worker cannot load
        assert "failed to start, stopping the parent process" in out, out[-3000:]
    assert _says_what_to_set(out), out[-3000:]


def test_serve_behind_a_tls_proxy_refuses_before_starting_anything(tmp_path):
    status, out = _run(_manage("serve", "--no-engine", "--port", str(free_port())), _behind_proxy_env(tmp_path))
    assert status == 1, (status, out[-3000:])
    assert _says_what_to_set(out), out[-3000:]
    assert "redis:" not in out  # nothing was started (serve prints the Redis it uses first)
    assert not (tmp_path / "var" / "log").exists()


def test_check_deploy_reports_the_missing_trusted_proxies(tmp_path):
    env = _behind_proxy_env(tmp_path)
    status, out = _run(_manage("check", "--deploy"), env)
    assert status not in (None, 0), out[-3000:]
    assert _says_what_to_set(out), out[-3000:]
    env["FORWARDED_ALLOW_IPS"] = "10.244.3.0/24, 10.244.7.0/24"
    status, out = _run(_manage("check", "--deploy"), env)
    assert status == 0 and "FORWARDED_ALLOW_IPS" not in out, out[-3000:]


def test_workers_behind_a_tls_proxy_are_not_concerned(tmp_path):
    """Only the api serves clients: a worker or ``migrate`` sharing the ConfigMap is not refused (``check`` loads
    the same settings and apps they do)."""
    status, out = _run(_manage("check"), _behind_proxy_env(tmp_path))
    assert status == 0, out[-3000:]


# ------------------------------------------------------------------------------------------------ follow-up
# A trusted-proxy list uvicorn would misread is refused like a missing one (config.asgi, serve, check --deploy):
# '*' (or a network of every address) lets any client that reaches the api (on 0.0.0.0) pick the address login
# throttling counts and the audit log records; an entry that is not an address or a network (a host name, a
# network with host bits set, a '*' among addresses) is one uvicorn keeps as a literal that matches no client: the
# proxy goes unbelieved.
EVERY_ADDRESS = ["*", "0.0.0.0/0", "::/0"]
NOT_AN_ADDRESS = ["ingress-nginx-controller.ingress-nginx.svc", "10.244.3.7/24", "10.244.3.0/24, *"]


def _says_to_list_the_proxies(out: str, value: str) -> bool:
    return f"FORWARDED_ALLOW_IPS={value!r}" in out and "the proxy's addresses or networks" in out


@pytest.mark.parametrize("workers", [1, 2])
def test_api_refuses_to_trust_every_address(tmp_path, workers):
    env = _behind_proxy_env(tmp_path) | {"FORWARDED_ALLOW_IPS": "*"}
    status, out = _run(_api_argv(env, workers), env)
    assert status is not None, "the api started: " + out[-3000:]
    if workers == 1:
        assert status == UVICORN_STARTUP_FAILURE, (status, out[-3000:])
    else:
        assert "failed to start, stopping the parent process" in out, out[-3000:]
    assert _says_to_list_the_proxies(out, "*"), out[-3000:]


def test_serve_refuses_to_trust_every_address_before_starting_anything(tmp_path):
    env = _behind_proxy_env(tmp_path) | {"FORWARDED_ALLOW_IPS": "*"}
    status, out = _run(_manage("serve", "--no-engine", "--port", str(free_port())), env)
    assert status == 1, (status, out[-3000:])
    assert _says_to_list_the_proxies(out, "*"), out[-3000:]
    assert "redis:" not in out and not (tmp_path / "var" / "log").exists()


@pytest.mark.parametrize("value", EVERY_ADDRESS + NOT_AN_ADDRESS)
def test_check_deploy_reports_a_trusted_proxy_list_uvicorn_would_misread(tmp_path, value):
    env = _behind_proxy_env(tmp_path) | {"FORWARDED_ALLOW_IPS": value}
    status, out = _run(_manage("check", "--deploy"), env)
    assert status not in (None, 0) and "ops.E001" in out, out[-3000:]
    assert _says_to_list_the_proxies(out, value.strip()), out[-3000:]


def test_every_address_is_refused_without_the_tls_proxy_too(tmp_path):
    """Not behind a TLS proxy the api listens to its clients directly: trusting '*' lets each pick its address."""
    env = _deployment_env(tmp_path, _safe(_env_example())) | {"FORWARDED_ALLOW_IPS": "*"}
    assert "DJANGO_BEHIND_TLS_PROXY" not in env
    status, out = _run(_manage("check", "--deploy"), env)
    assert status not in (None, 0) and _says_to_list_the_proxies(out, "*"), out[-3000:]


def test_k8s_api_as_shipped_waits_for_the_ingress_addresses(tmp_path):
    """deploy/k8s ships no trusted network (10.0.0.0/8 let every pod spoof its address on a CNI that does not
    enforce NetworkPolicy, flannel's): with its own secrets and nothing else changed the api refuses to start,
    saying what to set."""
    env = _deployment_env(tmp_path, _safe(_k8s_example()))
    status, out = _run(_api_argv(env), env)
    assert status == UVICORN_STARTUP_FAILURE, (status, out[-3000:])
    assert _says_what_to_set(out), out[-3000:]
