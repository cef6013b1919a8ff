"""Issue 14, Django side: TLS-deployment settings behind a switch, login throttling (django-axes), an optional
TOTP second factor for the admin (django-otp), new key secrets never in cookies, capped request bodies."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from asgiref.sync import sync_to_async
from asgiref.testing import ApplicationCommunicator
from django.contrib.auth import get_user_model
from django.contrib.messages.storage.cookie import CookieStorage
from django.test import AsyncClient, Client
from django.urls import reverse

from tenancy.models import ApiKey, Tenant
from tenancy.services import api_key_create

REPO = Path(__file__).resolve().parents[2]


def _django_env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DJANGO_BEHIND_TLS_PROXY",
                                                               "DJANGO_SECURE", "DJANGO_ADMIN_OTP")}
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)]),
                "DJANGO_SETTINGS_MODULE": "config.settings", "LLMP_VAR_DIR": str(tmp_path / "var"),
                "DJANGO_SECRET_KEY": "t-" + uuid.uuid4().hex * 2, "LOG_LEVEL": "WARNING"})
    env.update(extra)
    return env


_SETTINGS_PROBE = """
import json, django
django.setup()
from django.conf import settings as s
print(json.dumps({n: getattr(s, n) for n in ("SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE", "SECURE_HSTS_SECONDS",
      "SECURE_HSTS_INCLUDE_SUBDOMAINS", "SECURE_PROXY_SSL_HEADER", "SECURE_SSL_REDIRECT", "SESSION_COOKIE_HTTPONLY",
      "SESSION_COOKIE_SAMESITE", "CSRF_COOKIE_SAMESITE", "MESSAGE_STORAGE")}))
"""


def _settings(tmp_path, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", _SETTINGS_PROBE], env=_django_env(tmp_path, **env), cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _deploy_warnings(tmp_path, **env) -> set[str]:
    out = subprocess.run([sys.executable, "manage.py", "check", "--deploy"], env=_django_env(tmp_path, **env),
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    return set(re.findall(r"\(security\.W\d+\)", out.stdout + out.stderr))


def test_tls_switch_sets_secure_cookies_hsts_and_proxy_header(tmp_path):
    plain = _settings(tmp_path)
    assert plain["SESSION_COOKIE_HTTPONLY"] is True and plain["SESSION_COOKIE_SAMESITE"] == "Lax"
    assert plain["CSRF_COOKIE_SAMESITE"] == "Lax"
    assert plain["SESSION_COOKIE_SECURE"] is False and plain["SECURE_HSTS_SECONDS"] == 0  # quickstart: plain HTTP
    tls = _settings(tmp_path, DJANGO_BEHIND_TLS_PROXY="1")
    assert tls["SESSION_COOKIE_SECURE"] is True and tls["CSRF_COOKIE_SECURE"] is True
    assert tls["SECURE_HSTS_SECONDS"] >= 31_536_000 and tls["SECURE_HSTS_INCLUDE_SUBDOMAINS"] is True
    assert tls["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]
    assert tls["SECURE_SSL_REDIRECT"] is False
    assert _settings(tmp_path, DJANGO_SECURE="1", DJANGO_SSL_REDIRECT="1")["SECURE_SSL_REDIRECT"] is True
    cookie_and_hsts = {"(security.W004)", "(security.W012)", "(security.W016)"}  # HSTS, session/CSRF cookie secure
    assert cookie_and_hsts <= _deploy_warnings(tmp_path)
    assert not cookie_and_hsts & _deploy_warnings(tmp_path, DJANGO_BEHIND_TLS_PROXY="1")


@pytest.fixture
def users(db):
    User = get_user_model()
    alice = User.objects.create_user("alice", password="pw-alice-right-1", is_staff=True, is_superuser=True)
    bob = User.objects.create_user("bob", password="pw-bob-right-1", is_staff=True, is_superuser=True)
    return alice, bob


@pytest.mark.parametrize("login_url, landing", [("/admin/login/", "/admin/"), ("/accounts/login/", "/usage/")])
def test_login_throttled_per_user_after_failures(users, settings, login_url, landing):
    limit = settings.AXES_FAILURE_LIMIT
    assert limit == 5
    for attempt in range(1, limit + 1):  # the limit-th failure locks already (django-axes answers it with 429)
        r = Client().post(login_url, {"username": "alice", "password": "wrong", "next": landing})
        assert r.status_code == (200 if attempt < limit else 429)
    locked = Client()
    r = locked.post(login_url, {"username": "alice", "password": "pw-alice-right-1", "next": landing})
    assert r.status_code == 429 and "_auth_user_id" not in locked.session  # the right password is refused now
    other = Client()
    r = other.post(login_url, {"username": "bob", "password": "pw-bob-right-1", "next": landing})
    assert r.status_code == 302 and other.session["_auth_user_id"] == str(users[1].pk)  # bob is unaffected


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("db_connections_closed_in_their_threads")
async def test_login_throttled_through_the_asgi_handler(users):
    for attempt in range(1, 6):
        r = await AsyncClient().post("/admin/login/", {"username": "alice", "password": "wrong", "next": "/admin/"})
        assert r.status_code == (200 if attempt < 5 else 429)
    r = await AsyncClient().post("/admin/login/", {"username": "alice", "password": "pw-alice-right-1",
                                                    "next": "/admin/"})
    assert r.status_code == 429
    r = await AsyncClient().post("/admin/login/", {"username": "bob", "password": "pw-bob-right-1", "next": "/admin/"})
    assert r.status_code == 302


def test_admin_second_factor_when_switched_on(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "tests" / "security" / "otp_login_probe.py")],
                         env=_django_env(tmp_path, DJANGO_ADMIN_OTP="1"), cwd=REPO, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["site"] == "PlatformOTPAdminSite" and result["url_secret_matches"]
    assert result["no_token"]["status"] == 200 and result["no_token"]["index"] == 302  # form again, not let in
    assert result["wrong_token"]["status"] == 200 and result["wrong_token"]["index"] == 302
    assert result["good_token"]["status"] == 302 and result["good_token"]["index"] == 200


def test_admin_without_the_switch_needs_no_token(users):
    c = Client()
    r = c.post("/admin/login/", {"username": "bob", "password": "pw-bob-right-1", "next": "/admin/"})
    assert r.status_code == 302 and c.get("/admin/").status_code == 200


def test_new_key_secret_is_not_put_in_a_cookie(users):
    tenant = Tenant.objects.create(name="acme")
    c = Client()
    c.force_login(users[0])
    r = c.post(reverse("admin:tenancy_apikey_add"), {"tenant": tenant.pk, "name": "from-admin", "scopes": "inference",
                                                     "expires_at_0": "", "expires_at_1": ""})
    assert r.status_code == 302
    page = c.get(r["Location"]).content.decode()
    secret = re.findall(r"sk-[A-Za-z0-9]{8}\.[A-Za-z0-9_-]{43}", page)[0]  # still shown once, on the page
    assert secret.startswith(ApiKey.objects.get(name="from-admin").prefix)
    for response in (r,):
        for morsel in response.cookies.values():
            assert secret not in morsel.value and secret.split(".")[1] not in morsel.value
        if "messages" in response.cookies:  # Django's cookie storage signs but does not encrypt: decode it
            decoded = CookieStorage(None)._decode(response.cookies["messages"].value) or []
            assert not any(secret in str(m) for m in decoded)
    assert "messages" not in r.cookies


def test_admin_refuses_unsafe_key_names_with_a_form_error(users):
    tenant = Tenant.objects.create(name="acme")
    c = Client()
    c.force_login(users[0])
    r = c.post(reverse("admin:tenancy_apikey_add"), {"tenant": tenant.pk, "name": "<img src=x onerror=alert(1)>",
                                                     "scopes": "inference", "expires_at_0": "", "expires_at_1": ""})
    assert r.status_code == 200 and "name must be" in r.content.decode()
    assert not ApiKey.objects.exists()


class _DiskWrites:
    """Records files opened for writing in this process while active (a ``sys.addaudithook`` on ``open``)."""

    active = False
    seen: list = []

    @classmethod
    def hook(cls, event, args):
        if cls.active and event == "open":
            path, mode, flags = args
            if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags and flags & (os.O_WRONLY | os.O_RDWR)):
                cls.seen.append(path)


sys.addaudithook(_DiskWrites.hook)


async def _request(app, path: str, headers: list, chunks: list[bytes] | None):
    """Send an HTTP request to the ASGI ``app``; returns ``(status, body, chunks_sent_before_the_answer)``."""
    comm = ApplicationCommunicator(app, {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), *headers], "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 80)})
    sent = 0
    start = None
    for i, chunk in enumerate(chunks or []):
        await comm.send_input({"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1})
        sent += 1
        if not await comm.receive_nothing(timeout=0.2):  # the app answered: stop sending
            break
    if start is None:
        start = await comm.receive_output(timeout=30)
    body = await comm.receive_output(timeout=30)
    await comm.wait(timeout=30)
    return start["status"], body.get("body", b""), sent


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("db_connections_closed_in_their_threads")
async def test_large_bodies_to_django_routes_get_413_unread(settings):
    from config.asgi import application

    tenant = await sync_to_async(Tenant.objects.create)(name="acme")
    _, secret = await sync_to_async(api_key_create)(tenant=tenant, name="admin", scopes=["inference", "keys:write"])
    auth = (b"authorization", f"Bearer {secret}".encode())
    _DiskWrites.seen.clear()
    _DiskWrites.active = True
    try:
        # 50 MB declared: refused before a byte of body is read (none is sent)
        status, body, _ = await _request(application, "/api/v1/keys", [auth, (b"content-length", b"52428800"),
                                                                       (b"content-type", b"application/json")], None)
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
        # chunked, no length: refused once past the cap, long before 50 MB arrive
        chunk = b"x" * (1 << 20)
        status, body, sent = await _request(application, "/api/v1/keys",
                                            [auth, (b"content-type", b"application/json")], [chunk] * 50)
        assert status == 413 and sent <= settings.DJANGO_MAX_BODY_BYTES // len(chunk) + 1
    finally:
        _DiskWrites.active = False
    assert _DiskWrites.seen == []
    # a body within the cap still reaches the view intact
    payload = json.dumps({"name": "small", "allowed_models": ["m" * 100] * 100}).encode()
    status, body, _ = await _request(application, "/api/v1/keys",
                                     [auth, (b"content-type", b"application/json"),
                                      (b"content-length", str(len(payload)).encode())],
                                     [payload[:1000], payload[1000:]])
    assert status == 201, body
    assert json.loads(body)["name"] == "small"
