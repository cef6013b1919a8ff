"""Issue 39, item 2: with ``DJANGO_ADMIN_OTP=1`` the all-tenant usage WebSocket (the operator dashboard's live feed)
needs the same second factor as the admin: a session that logged in with the password only (``/accounts/login/``)
is refused it, as the admin and its ``/admin/usage-data`` refuse that session; a session verified with a TOTP code
(``/admin/login/``) gets it; a tenant owner's own view needs no second factor (as ``/usage/`` does not).

Run by ``otp_ws_probe.py`` in a process of its own (the switch is read at start-up), over a scratch SQLite database
and a real Redis channel layer (``REDIS_URL`` or the local Redis, under a random prefix).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from tests.support.redis import TEST_REDIS_URL, redis_or_skip
from harness.redis_keys import delete_prefix

REPO = Path(__file__).resolve().parents[2]


def _probe(tmp_path) -> dict:
    redis_or_skip().close()
    prefix = f"otpws{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DJANGO_BEHIND_TLS_PROXY", "DJANGO_SECURE")}
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)]),
                "DJANGO_SETTINGS_MODULE": "config.settings", "LLMP_VAR_DIR": str(tmp_path / "var"),
                "DJANGO_SECRET_KEY": "t-" + uuid.uuid4().hex * 2, "LOG_LEVEL": "WARNING", "DJANGO_ADMIN_OTP": "1",
                "REDIS_URL": TEST_REDIS_URL, "LINK_PREFIX": prefix})
    try:
        out = subprocess.run([sys.executable, str(REPO / "tests" / "security" / "otp_ws_probe.py")], env=env,
                             cwd=REPO, capture_output=True, text=True, timeout=180)
    finally:
        delete_prefix(TEST_REDIS_URL, prefix)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_all_tenant_feed_needs_the_verified_second_factor(tmp_path):
    result = _probe(tmp_path)

    password_only = result["password_only"]
    assert password_only["login"] == 302  # logged in, with the password alone
    assert password_only["usage_data"] == 302  # the admin's JSON of the same figures sends it to the login page
    ws = password_only["ws"]
    assert ws["connect"] == "websocket.accept"
    assert "totals" not in ws["first"] and ws["first"]["error"]["code"] == "forbidden", ws
    assert ws["then"] == {"type": "websocket.close", "code": 4403}, ws

    verified = result["with_token"]
    assert verified["login"] == 302 and verified["usage_data"] == 200
    ws = verified["ws"]
    assert ws["first"]["totals"]["requests"] == 2, ws  # every tenant's usage
    assert ws["then"] is None  # the feed stays open

    owner = result["tenant_owner"]["ws"]
    assert owner["first"]["totals"]["requests"] == 1 and owner["then"] is None, owner  # its own tenant only
