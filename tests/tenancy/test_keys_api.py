"""``/api/v1/keys``: create (secret once), list, change, revoke, rotate with grace; scopes; isolation."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.test import APIClient

from tenancy.models import ApiKey, Tenant
from tenancy.selectors import api_key_authenticate
from tenancy.services import api_key_create

pytestmark = pytest.mark.django_db


@pytest.fixture
def tenant():
    return Tenant.objects.create(name="acme", rpm_limit=100)


@pytest.fixture
def admin_key(tenant):
    # holds "inference" too: a key may only create keys with scopes it holds itself
    _, plaintext = api_key_create(tenant=tenant, name="admin", scopes=["inference", "keys:write", "usage:read"])
    return plaintext


def _client(secret: str | None = None) -> APIClient:
    client = APIClient()
    if secret:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


def test_create_shows_secret_once_and_list_never(tenant, admin_key):
    c = _client(admin_key)
    r = c.post("/api/v1/keys", {"name": "ci", "scopes": ["inference"], "allowed_models": ["m1"], "rpm_limit": 5,
                                "tpm_limit": 1000, "max_concurrent_requests": 2, "token_budget": 10_000,
                                "budget_period": "day"}, format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    secret = body["key"]
    assert secret.startswith(body["prefix"] + ".")
    ctx = api_key_authenticate(secret)
    assert ctx is not None and ctx.tenant_id == tenant.pk and ctx.allowed_models == ("m1",)
    assert (ctx.key_limits.rpm, ctx.key_limits.tpm, ctx.key_limits.max_concurrent, ctx.key_limits.token_budget,
            ctx.key_limits.budget_period) == (5, 1000, 2, 10_000, "day")
    assert ctx.tenant_limits.rpm == 100
    listing = c.get("/api/v1/keys")
    assert listing.status_code == 200
    text = listing.content.decode()
    assert secret not in text and secret.split(".", 1)[1] not in text and "secret_hash" not in text
    assert {k["name"] for k in listing.json()} == {"admin", "ci"}
    assert all("key" not in k for k in listing.json())
    one = c.get(f"/api/v1/keys/{body['id']}").json()
    assert one["prefix"] == body["prefix"] and "key" not in one and one["status"] == "active"


def test_scopes_and_auth_errors_use_the_openai_envelope(tenant, admin_key):
    _, inference_only = api_key_create(tenant=tenant, name="inf")
    r = _client(inference_only).get("/api/v1/keys")
    assert r.status_code == 403
    assert r.json()["error"]["type"] == "permission_error" and "keys:write" in r.json()["error"]["message"]
    r = _client().get("/api/v1/keys")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = _client("sk-AAAAAAAA.nope").get("/api/v1/keys")
    assert r.status_code == 401
    r = _client(admin_key).post("/api/v1/keys", {"name": "x", "scopes": ["metrics"]}, format="json")
    assert r.status_code == 400 and r.json()["error"]["param"] == "scopes[0]"  # operator scope refused
    r = _client(admin_key).post("/api/v1/keys", {"scopes": ["inference"]}, format="json")
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"


def test_revoke_update_and_tenant_isolation(tenant, admin_key):
    other = Tenant.objects.create(name="other")
    other_key, _ = api_key_create(tenant=other, name="theirs")
    c = _client(admin_key)
    assert c.get(f"/api/v1/keys/{other_key.pk}").status_code == 404
    assert c.delete(f"/api/v1/keys/{other_key.pk}").status_code == 404
    assert c.post(f"/api/v1/keys/{other_key.pk}/rotate", {}, format="json").status_code == 404
    assert ApiKey.objects.get(pk=other_key.pk).revoked_at is None

    created = c.post("/api/v1/keys", {"name": "tmp"}, format="json").json()
    r = c.patch(f"/api/v1/keys/{created['id']}", {"rpm_limit": 7, "allowed_models": ["a", "b"]}, format="json")
    assert r.status_code == 200 and r.json()["rpm_limit"] == 7
    assert api_key_authenticate(created["key"]).key_limits.rpm == 7
    r = c.delete(f"/api/v1/keys/{created['id']}")
    assert r.status_code == 200 and r.json()["status"] == "revoked"
    assert api_key_authenticate(created["key"]) is None
    # revoked, not deleted: listed as such, but reading, changing or rotating it answers 410 (D-178)
    assert c.delete(f"/api/v1/keys/{created['id']}").json()["revoked_at"] == r.json()["revoked_at"]  # idempotent
    listed = {k["id"]: k["status"] for k in c.get("/api/v1/keys").json()}
    assert listed[created["id"]] == "revoked"
    for gone in (c.get(f"/api/v1/keys/{created['id']}"),
                 c.patch(f"/api/v1/keys/{created['id']}", {"name": "z"}, format="json"),
                 c.post(f"/api/v1/keys/{created['id']}/rotate", {}, format="json")):
        assert gone.status_code == 410 and gone.json()["error"]["code"] == "key_revoked", gone.content


def test_bad_scope_is_a_plain_400_naming_the_item(tenant, admin_key):
    from django.core.management import CommandError, call_command

    c = _client(admin_key)
    created = c.post("/api/v1/keys", {"name": "s"}, format="json").json()
    r = c.patch(f"/api/v1/keys/{created['id']}", {"scopes": ["inference", "foo"]}, format="json")
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "scopes[1]"
    assert "ErrorDetail" not in err["message"] and '"foo" is not a valid choice' in err["message"]
    with pytest.raises(ValueError, match="unknown scope 'foo'"):
        api_key_create(tenant=tenant, name="x", scopes=["foo"])
    with pytest.raises(CommandError, match="unknown scope"):
        call_command("create_api_key", "--tenant", tenant.name, "--name", "y", "--scopes", "foo")


def test_rotate_with_grace_keeps_old_secret_until_expiry(tenant, admin_key):
    c = _client(admin_key)
    created = c.post("/api/v1/keys", {"name": "svc", "rpm_limit": 9, "scopes": ["inference", "usage:read"]},
                     format="json").json()
    r = c.post(f"/api/v1/keys/{created['id']}/rotate", {"grace_period_s": 3600}, format="json")
    assert r.status_code == 201
    new = r.json()
    assert new["key"] != created["key"] and new["rpm_limit"] == 9 and new["scopes"] == ["inference", "usage:read"]
    old = ApiKey.objects.get(pk=created["id"])
    assert old.replaced_by_id == new["id"]
    assert timedelta(minutes=59) < old.expires_at - timezone.now() <= timedelta(hours=1)
    assert api_key_authenticate(created["key"]) is not None  # grace period
    assert api_key_authenticate(new["key"]) is not None
    ApiKey.objects.filter(pk=old.pk).update(expires_at=timezone.now() - timedelta(seconds=1))  # grace over
    assert api_key_authenticate(created["key"]) is None
    # rotating without grace revokes the old secret at once
    newer = c.post(f"/api/v1/keys/{new['id']}/rotate", {}, format="json").json()
    assert api_key_authenticate(new["key"]) is None and api_key_authenticate(newer["key"]) is not None


def test_session_owner_manages_only_their_tenant(tenant):
    User = get_user_model()
    owner = User.objects.create_user("alice", password="pw-alice-123")
    tenant.owner = owner
    tenant.save()
    stranger = User.objects.create_user("bob", password="pw-bob-123")
    c = APIClient(enforce_csrf_checks=False)
    c.force_login(owner)
    r = c.post("/api/v1/keys", {"name": "from-session"}, format="json")
    assert r.status_code == 201 and ApiKey.objects.get(pk=r.json()["id"]).tenant_id == tenant.pk
    s = APIClient()
    s.force_login(stranger)
    assert s.get("/api/v1/keys").status_code == 403


def test_openapi_schema_and_offline_docs(admin_key, tenant):
    c = _client(admin_key)
    schema = c.get("/api/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    doc = schema.json()
    assert {"/api/v1/keys", "/api/v1/keys/{id}", "/api/v1/keys/{id}/rotate", "/api/v1/usage"} <= set(doc["paths"])
    assert _client().get("/api/v1/schema").status_code in (401, 403)
    User = get_user_model()
    user = User.objects.create_user("carol", password="pw-carol-123")
    web = APIClient()
    web.force_login(user)
    page = web.get("/api/v1/docs").content.decode()
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js" in page and "http" not in page.split(
        "<body>")[1].split("url:")[0]
    asset = web.get("/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js")
    assert asset.status_code == 200 and len(b"".join(asset.streaming_content)) > 100_000
    assert web.get("/static/drf_spectacular_sidecar/redoc/bundles/redoc.standalone.js").status_code == 200
    assert "redoc.standalone.js" in web.get("/api/v1/redoc").content.decode()
    chart = web.get("/static/usage/vendor/chart.umd.min.js")
    assert chart.status_code == 200
    assert web.get("/static/../../settings.py").status_code == 404
