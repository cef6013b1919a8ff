"""Issue 14, the processes ``manage.py serve`` starts: the embedded Redis requires a password that is on no command
line, and ``var/`` (database, logs, secrets, unix sockets) is private to the user running serve.

One platform is started as the README's quickstart starts it (``manage.py serve --demo``, embedded Redis, SQLite,
the demo engine, the multimodal api), over a ``var/`` that an earlier run left with loose modes and a Redis
password file; the tests then look at it from outside, as another local user's process would.
"""

from __future__ import annotations

import os
import secrets
import shlex
import stat
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tests.frontend.test_serve_split import _descendants
from harness.serve import cmdline as _cmdline, banner_key, serve_banner, stop_serve
from harness import REPO
from harness.assets import ensure_demo_assets
from harness.live_platform import free_port
from tests.support.live import stop_in_background

pytestmark = pytest.mark.timeout(600)


def _env(var_dir: Path) -> dict:
    env = dict(os.environ, LLMP_VAR_DIR=str(var_dir), LINK_PREFIX=f"oh{uuid.uuid4().hex[:8]}", LOG_LEVEL="WARNING",
               EMBEDDED_REDIS_PORT=str(free_port()),
               PYTHONPATH=os.pathsep.join([str(REPO / "platform"), str(REPO)]))
    for name in ("DATABASE_URL", "REDIS_URL", "DJANGO_SECRET_KEY", "SECRET_KEY"):
        env.pop(name, None)  # the quickstart's defaults: SQLite and the embedded Redis, secrets under var/
    return env


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``manage.py serve --demo`` over a ``var/`` left by an earlier run with loose modes (a world-readable log,
    password file and directories, as a umask of 022 makes them); yields what its banner printed."""
    ensure_demo_assets()
    var_dir = tmp_path_factory.mktemp("ops") / "var"
    (var_dir / "log").mkdir(parents=True)
    (var_dir / "run").mkdir()
    (var_dir / "log" / "old.log").write_text("an earlier run\n")
    old_password = secrets.token_urlsafe(40)
    (var_dir / "redis_password").write_text(old_password)
    for path, mode in ((var_dir, 0o755), (var_dir / "log", 0o755), (var_dir / "run", 0o777),
                       (var_dir / "log" / "old.log", 0o644), (var_dir / "redis_password", 0o644)):
        os.chmod(path, mode)
    env = _env(var_dir)
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "manage.py"), "serve", "--demo", "--port", str(port)],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        lines = serve_banner(proc.stdout, 420)
        yield {"proc": proc, "var": var_dir, "base": f"http://127.0.0.1:{port}", "lines": lines,
               "redis_port": int(env["EMBEDDED_REDIS_PORT"]), "old_password": old_password,
               "key": banner_key(lines)}
    finally:
        stop_in_background("ops-hardening serve", lambda: stop_serve(proc))


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_var_and_everything_in_it_is_private_to_the_user(served):
    var_dir: Path = served["var"]
    seen = {}
    for dirpath, dirnames, filenames in os.walk(var_dir):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                seen[str(path.relative_to(var_dir))] = _mode(path)
    # what serve and its children wrote (the database, logs, secrets, beat's schedule) and what was there before
    for name in ("db.sqlite3", "log/api.log", "log/redis.log", "log/old.log", "operator_password", "demo_api_key",
                 "secret_key", "redis_password", "run"):
        assert name in seen, sorted(seen)
    assert _mode(var_dir) == 0o700
    loose = {name: oct(mode) for name, mode in seen.items()
             if mode != (0o700 if (var_dir / name).is_dir() else 0o600)}
    assert not loose, loose


def test_the_multimodal_api_socket_is_not_world_writable(served):
    socks = sorted(p for p in (served["var"] / "run").iterdir() if stat.S_ISSOCK(os.lstat(p).st_mode))
    assert {p.name: oct(_mode(p)) for p in socks} == {"mm-api.sock": "0o600"}, socks


def test_embedded_redis_refuses_clients_without_the_password_and_the_platform_works(served):
    port = served["redis_port"]
    with pytest.raises(redis.AuthenticationError):  # NOAUTH, for a local process that does not know it
        redis.Redis(host="127.0.0.1", port=port, socket_timeout=5).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=port, socket_timeout=5).xadd("llmp:x", {"a": "b"})
    # the password an earlier run left is kept (a restart changes nothing for clients that hold it)
    password = (served["var"] / "redis_password").read_text().strip()
    assert password == served["old_password"]
    client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=5)
    assert client.ping()
    assert client.config_get("bind") == {"bind": "127.0.0.1"}
    # the serve banner names the URL without its password
    redis_line = next(ln for ln in served["lines"] if ln.startswith("redis:"))
    assert password not in redis_line and "redis_password" in redis_line, redis_line

    # end to end: the api, the render worker, the engine and the usage worker all reach Redis with it
    api = openai.OpenAI(base_url=served["base"] + "/v1", api_key=served["key"], max_retries=0, timeout=60)
    chat = api.chat.completions.create(model="tiny-qwen3", messages=[{"role": "user", "content": "Hello!"}],
                                       max_tokens=8)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
    text = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
        model="tiny-qwen3", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, stream=True)
        if c.choices)
    assert isinstance(text, str)
    # the banner's curl line works as printed (it carries the API key, nothing of Redis)
    curl = next(ln.strip() for ln in served["lines"] if ln.strip().startswith("curl -s"))
    out = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and '"chat.completion"' in out.stdout, (out.stdout, out.stderr)


def _banner_login(lines: list[str], who: str) -> tuple[str, str]:
    """``(username, password)`` of the banner's ``<who> login: USER / PASSWORD  (...)`` line."""
    line = next(ln for ln in lines if ln.startswith(f"{who} login: "))
    username, _, password = line.removeprefix(f"{who} login: ").split("  (")[0].strip().partition(" / ")
    return username, password


def _dashboard_login(base: str, username: str, password: str) -> httpx.Response:
    """Log in on the dashboards' login page, asking for ``/usage/``; the page the redirects end on."""
    with httpx.Client(base_url=base, follow_redirects=True, timeout=60) as http:
        http.get("/accounts/login/?next=/usage/")
        return http.post("/accounts/login/?next=/usage/", data={
            "username": username, "password": password, "next": "/usage/",
            "csrfmiddlewaretoken": http.cookies["csrftoken"]})


def test_quickstart_banner_examples_and_logins_work_as_printed(served):
    """Issue 17: the quickstart serves all-MiniLM-L6-v2 too; the banner's python snippet (a chat stream, then
    ``client.embeddings.create``) and both curl lines run as printed; its tenant login opens the demo tenant's
    dashboard, its operator login (asking for ``/usage/``) the operator dashboard."""
    lines = served["lines"]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("python (pip install openai)"))
    block = []
    for ln in lines[start + 1:]:
        if not ln.startswith("  "):
            break
        block.append(ln)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("".join(block))], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.rstrip().endswith("2 vectors of 384"), out.stdout
    curls = [ln.strip() for ln in lines if ln.strip().startswith("curl -s")]
    assert len(curls) == 2 and "/v1/embeddings" in curls[1], curls
    emb = subprocess.run(shlex.split(curls[1]), capture_output=True, text=True, timeout=60)
    assert emb.returncode == 0 and '"embedding"' in emb.stdout and '"all-MiniLM-L6-v2"' in emb.stdout, emb.stdout

    page = _dashboard_login(served["base"], *_banner_login(lines, "tenant"))
    assert page.status_code == 200 and page.url.path == "/usage/", (page.status_code, page.url)
    assert "Usage — demo" in page.text
    page = _dashboard_login(served["base"], *_banner_login(lines, "operator"))
    assert page.status_code == 200 and page.url.path == "/admin/usage/usagerollup/", (page.status_code, page.url)
    assert 'data-operator="1"' in page.text


def test_no_process_shows_the_redis_password_on_its_command_line(served):
    password = (served["var"] / "redis_password").read_text().strip()
    cmdlines = {pid: _cmdline(pid) for pid in _descendants(served["proc"].pid)}
    names = " ".join(cmdlines.values())
    assert "inference.engine" in names and "redis-server" in names and "celery" in names, cmdlines
    shown = {pid: cmd for pid, cmd in cmdlines.items() if password in cmd or "redis://" in cmd}
    assert not shown, shown


def test_the_password_file_is_made_once_private_and_made_again_when_missing(tmp_path):
    """Any process started without ``REDIS_URL`` (serve, a management command) finds the same password."""
    env = _env(tmp_path)
    code = "from django.conf import settings; print(settings.REDIS_URL)"
    url = lambda: subprocess.run([sys.executable, "-c", f"import django; django.setup(); {code}"],
                                 env=dict(env, DJANGO_SETTINGS_MODULE="config.settings"), cwd=REPO,
                                 capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    first = url()
    path = tmp_path / "redis_password"
    password = path.read_text().strip()
    assert _mode(path) == 0o600 and len(password) >= 43  # 32+ random bytes, URL-safe base64
    assert first == f"redis://:{password}@127.0.0.1:{env['EMBEDDED_REDIS_PORT']}/0"
    assert url() == first
    path.unlink()
    again = url()
    assert path.exists() and again != first and path.read_text().strip() in again


def test_a_command_started_without_the_port_finds_serves_embedded_redis(served):
    """``serve`` ran on a port of its own (``EMBEDDED_REDIS_PORT``); a management command started later without
    the variable (another shell) reaches that server: ``var/redis_port`` holds the port. Before, it tried 6390
    and ``admission_policy`` failed with a connection error (the limit was never published)."""
    path = served["var"] / "redis_port"
    assert path.read_text().strip() == str(served["redis_port"]) and _mode(path) == 0o600
    env = _env(served["var"])
    env.pop("EMBEDDED_REDIS_PORT")
    code = "from django.conf import settings; import redis; print(redis.Redis.from_url(settings.REDIS_URL).ping())"
    out = subprocess.run([sys.executable, "-c", f"import django; django.setup(); {code}"],
                         env=dict(env, DJANGO_SETTINGS_MODULE="config.settings"), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]
