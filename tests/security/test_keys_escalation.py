"""Issue 14: a ``keys:write`` key may never make, change or rotate a key wider than itself; it never touches
keys with operator scopes nor itself (bar revoking); a rotation's grace period holds; keys per tenant are capped;
key names use a safe character set."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.utils import timezone
from rest_framework.test import APIClient

from tenancy.api.serializers import ApiKeyWriteSerializer
from tests.support.api_client import bearer_client
from tenancy.models import ApiKey
from tenancy.selectors import api_key_authenticate
from tenancy.services import api_key_create

pytestmark = pytest.mark.django_db


def _limited_admin(tenant, **overrides):
    """A keys:write key with models, expiry and every limit set; returns ``(key, client)``."""
    fields = dict(scopes=["inference", "keys:write"], allowed_models=["m1", "m2"],
                  expires_at=timezone.now() + timedelta(hours=1),
                  limits={"rpm_limit": 10, "tpm_limit": 1000, "max_concurrent_requests": 2, "token_budget": 5000,
                          "budget_period": "week"})
    fields.update(overrides)
    key, secret = api_key_create(tenant=tenant, name="limited-admin", **fields)
    return key, bearer_client(secret)


def _iso(delta: timedelta) -> str:
    return (timezone.now() + delta).isoformat()


def _ok_child(**changes) -> dict:
    body = {"name": "child", "scopes": ["inference"], "allowed_models": ["m1"], "expires_at": _iso(timedelta(minutes=30)),
            "rpm_limit": 10, "tpm_limit": 500, "max_concurrent_requests": 1, "token_budget": 5000,
            "budget_period": "month"}
    body.update(changes)
    return body


def _refused(response, status: int, param: str | None):
    assert response.status_code == status, response.content
    err = response.json()["error"]
    assert err["type"] == ("permission_error" if status == 403 else "invalid_request_error")
    assert err["param"] == param, err
    assert err["message"]
    return err


@pytest.mark.parametrize("changes, param", [
    ({"allowed_models": ["m1", "m3"]}, "allowed_models"),
    ({"allowed_models": []}, "allowed_models"),            # every model, from a key limited to two
    ({"expires_at": None}, "expires_at"),
    ({"expires_at": _iso(timedelta(hours=2))}, "expires_at"),
    ({"rpm_limit": None}, "rpm_limit"),
    ({"rpm_limit": 11}, "rpm_limit"),
    ({"tpm_limit": None}, "tpm_limit"),
    ({"max_concurrent_requests": 3}, "max_concurrent_requests"),
    ({"token_budget": None}, "token_budget"),
    ({"token_budget": 5001}, "token_budget"),
    ({"budget_period": "day"}, "budget_period"),            # 5,000 a day is looser than 5,000 a week
    ({"scopes": ["inference", "usage:read"]}, "scopes"),   # a scope the actor lacks
])
def test_key_cannot_create_a_wider_key(tenant, changes, param):
    _actor, c = _limited_admin(tenant)
    before = ApiKey.objects.count()
    _refused(c.post("/api/v1/keys", _ok_child(**changes), format="json"), 403, param)
    assert ApiKey.objects.count() == before
    r = c.post("/api/v1/keys", _ok_child(), format="json")  # the same child, no wider than the actor
    assert r.status_code == 201, r.content
    assert api_key_authenticate(r.json()["key"]).key_limits.rpm == 10


def test_default_scopes_are_checked_too(tenant):
    _actor, c = _limited_admin(tenant, scopes=["keys:write"])
    body = _ok_child()
    del body["scopes"]  # default ["inference"], which this actor does not hold
    _refused(c.post("/api/v1/keys", body, format="json"), 403, "scopes")


def test_key_cannot_widen_another_key_or_rotate_or_revoke_a_wider_one(tenant):
    _actor, c = _limited_admin(tenant)
    child = c.post("/api/v1/keys", _ok_child(), format="json").json()
    for changes, param in (({"expires_at": None}, "expires_at"), ({"rpm_limit": None}, "rpm_limit"),
                           ({"allowed_models": []}, "allowed_models"), ({"max_concurrent_requests": 9},
                                                                         "max_concurrent_requests")):
        _refused(c.patch(f"/api/v1/keys/{child['id']}", changes, format="json"), 403, param)
    stored = ApiKey.objects.get(pk=child["id"])
    assert stored.expires_at is not None and stored.rpm_limit == 10 and stored.allowed_models == ["m1"]
    assert c.patch(f"/api/v1/keys/{child['id']}", {"rpm_limit": 5}, format="json").status_code == 200

    wide, _ = api_key_create(tenant=tenant, name="wide", scopes=["inference"], allowed_models=["m1"])  # no expiry
    _refused(c.patch(f"/api/v1/keys/{wide.pk}", {"name": "renamed"}, format="json"), 403, "expires_at")
    before = ApiKey.objects.count()
    r = c.post(f"/api/v1/keys/{wide.pk}/rotate", {"grace_period_s": 60}, format="json")
    _refused(r, 403, "expires_at")
    assert "key" not in r.json() and ApiKey.objects.count() == before
    wide.refresh_from_db()
    assert wide.replaced_by_id is None and wide.expires_at is None
    # nor revoke it (a leaked narrow key must not be able to cut off the tenant's wider keys); its own child it may
    _refused(c.delete(f"/api/v1/keys/{wide.pk}"), 403, "expires_at")
    _refused(c.post(f"/api/v1/keys/{wide.pk}/revoke"), 403, "expires_at")
    wide.refresh_from_db()
    assert wide.revoked_at is None
    assert c.delete(f"/api/v1/keys/{child['id']}").json()["status"] == "revoked"


def test_key_cannot_change_or_rotate_itself_but_may_revoke_itself(tenant):
    actor, c = _limited_admin(tenant)
    for changes in ({"expires_at": None}, {"rpm_limit": None}, {"token_budget": None}, {"allowed_models": []},
                    {"expires_at": _iso(timedelta(days=30))}, {"name": "me"}):
        _refused(c.patch(f"/api/v1/keys/{actor.pk}", changes, format="json"), 403, None)
    _refused(c.post(f"/api/v1/keys/{actor.pk}/rotate", {}, format="json"), 403, None)
    stored = ApiKey.objects.get(pk=actor.pk)
    assert (stored.expires_at, stored.rpm_limit, stored.token_budget, stored.allowed_models, stored.replaced_by_id) == (
        actor.expires_at, 10, 5000, ["m1", "m2"], None)
    assert c.delete(f"/api/v1/keys/{actor.pk}").json()["status"] == "revoked"


def test_operator_scoped_keys_are_out_of_reach(tenant):
    _, unrestricted = api_key_create(tenant=tenant, name="tenant-admin", scopes=["inference", "keys:write"])
    prom, prom_secret = api_key_create(tenant=tenant, name="prometheus", scopes=["metrics"])
    owner = get_user_model().objects.create_user("olga", password="pw-olga-123")
    tenant.owner = owner
    tenant.save()
    session = APIClient()
    session.force_login(owner)
    for c in (bearer_client(unrestricted), session):
        _refused(c.patch(f"/api/v1/keys/{prom.pk}", {"scopes": ["inference"]}, format="json"), 403, None)
        _refused(c.post(f"/api/v1/keys/{prom.pk}/rotate", {}, format="json"), 403, None)
        _refused(c.delete(f"/api/v1/keys/{prom.pk}"), 403, None)
        _refused(c.post(f"/api/v1/keys/{prom.pk}/revoke"), 403, None)
    assert api_key_authenticate(prom_secret).scopes == ("metrics",)
    assert ApiKey.objects.filter(tenant=tenant).count() == 2


def test_rotation_grace_period_cannot_be_undone_or_extended(tenant):
    _, admin_secret = api_key_create(tenant=tenant, name="tenant-admin", scopes=["inference", "keys:write"])
    owner = get_user_model().objects.create_user("omar", password="pw-omar-123")
    tenant.owner = owner
    tenant.save()
    session = APIClient()
    session.force_login(owner)
    c = bearer_client(admin_secret)
    old = c.post("/api/v1/keys", {"name": "svc"}, format="json").json()
    assert c.post(f"/api/v1/keys/{old['id']}/rotate", {"grace_period_s": 600}, format="json").status_code == 201
    grace_end = ApiKey.objects.get(pk=old["id"]).expires_at
    for client in (c, session):
        _refused(client.patch(f"/api/v1/keys/{old['id']}", {"expires_at": None}, format="json"), 403, "expires_at")
        _refused(client.patch(f"/api/v1/keys/{old['id']}", {"expires_at": _iso(timedelta(days=1))}, format="json"),
                 403, "expires_at")
        _refused(client.post(f"/api/v1/keys/{old['id']}/rotate", {"grace_period_s": 600}, format="json"), 409, None)  # already rotated: a conflict (D-178)
    assert ApiKey.objects.get(pk=old["id"]).expires_at == grace_end
    earlier = c.patch(f"/api/v1/keys/{old['id']}", {"expires_at": _iso(timedelta(minutes=1))}, format="json")
    assert earlier.status_code == 200 and ApiKey.objects.get(pk=old["id"]).expires_at < grace_end


def test_keys_per_tenant_are_capped(tenant, settings):
    settings.MAX_API_KEYS_PER_TENANT = 3
    _, admin_secret = api_key_create(tenant=tenant, name="tenant-admin", scopes=["inference", "keys:write"])
    api_key_create(tenant=tenant, name="gone", expires_at=timezone.now() - timedelta(seconds=1))  # not counted
    c = bearer_client(admin_secret)
    first = c.post("/api/v1/keys", {"name": "a"}, format="json")
    assert first.status_code == 201
    assert c.post("/api/v1/keys", {"name": "b"}, format="json").status_code == 201
    err = _refused(c.post("/api/v1/keys", {"name": "c"}, format="json"), 403, None)
    assert err["code"] == "api_key_limit_reached" and "3" in err["message"]
    _refused(c.post(f"/api/v1/keys/{first.json()['id']}/rotate", {"grace_period_s": 60}, format="json"), 403, None)
    with pytest.raises(Exception, match="3 active API keys"):
        api_key_create(tenant=tenant, name="by-operator")
    assert c.delete(f"/api/v1/keys/{first.json()['id']}").status_code == 200  # frees a slot
    assert c.post("/api/v1/keys", {"name": "c"}, format="json").status_code == 201


@pytest.mark.parametrize("name", ["<script>alert(1)</script>", "a" * 101, "tab\there", "new\nline", "", "   ",
                                  "quote\"s", "emoji \U0001F600", "back\\slash"])
def test_unsafe_key_names_are_refused(tenant, name):
    _, admin_secret = api_key_create(tenant=tenant, name="tenant-admin", scopes=["inference", "keys:write"])
    c = bearer_client(admin_secret)
    _refused(c.post("/api/v1/keys", {"name": name}, format="json"), 400, "name")
    ser = ApiKeyWriteSerializer(data={"name": name})
    assert not ser.is_valid() and "name" in ser.errors  # the serializer refuses it already, not only the service
    ok = c.post("/api/v1/keys", {"name": "ok"}, format="json").json()
    _refused(c.patch(f"/api/v1/keys/{ok['id']}", {"name": name}, format="json"), 400, "name")
    with pytest.raises(ValueError, match="name"):
        api_key_create(tenant=tenant, name=name)
    with pytest.raises(CommandError, match="name"):
        call_command("create_api_key", "--tenant", tenant.name, "--name", name)
    assert set(ApiKey.objects.values_list("name", flat=True)) == {"tenant-admin", "ok"}


def test_safe_key_names_are_accepted(tenant):
    _, admin_secret = api_key_create(tenant=tenant, name="tenant-admin", scopes=["inference", "keys:write"])
    name = "ci-bot_01 prod.eu:v2 ops@example.com/x (old)"
    r = bearer_client(admin_secret).post("/api/v1/keys", {"name": name}, format="json")
    assert r.status_code == 201 and r.json()["name"] == name
    assert api_key_create(tenant=tenant, name="a" * 100)[0].name == "a" * 100


def test_priority_tier_can_only_be_lowered(tenant):
    """A key's tier never beats its tenant's (even set by an operator), a key sets no better tier than its own,
    and the tenant's tier and weight are not in the tenant-side API at all."""
    tenant.priority_tier, tenant.fair_share_weight = 1, 3
    tenant.save()
    boosted, secret = api_key_create(tenant=tenant, name="op-boosted", limits={"priority_tier": 0})  # an operator
    ctx = api_key_authenticate(secret)
    assert boosted.effective_priority_tier == 1 and ctx.priority_tier == 1 and ctx.fair_share_weight == 3
    actor, c = _limited_admin(tenant, limits={"priority_tier": 1})
    _refused(c.post("/api/v1/keys", _ok_child(priority_tier=0), format="json"), 403, "priority_tier")
    _refused(c.post("/api/v1/keys", _ok_child(), format="json"), 403, "priority_tier")  # unset = the tenant's
    _refused(c.post("/api/v1/keys", _ok_child(priority_tier=3), format="json"), 400, "priority_tier")
    r = c.post("/api/v1/keys", _ok_child(priority_tier=2), format="json")
    assert r.status_code == 201, r.content
    assert r.json()["priority_tier"] == 2 and r.json()["effective_priority_tier"] == 2
    assert api_key_authenticate(r.json()["key"]).priority_tier == 2
    child = r.json()["id"]
    _refused(c.patch(f"/api/v1/keys/{child}", {"priority_tier": 0}, format="json"), 403, "priority_tier")
    _refused(c.patch(f"/api/v1/keys/{child}", {"priority_tier": -1}, format="json"), 400, "priority_tier")
    r = c.patch(f"/api/v1/keys/{child}", {"fair_share_weight": 100}, format="json")  # not a key field: ignored
    assert ApiKey.objects.get(pk=child).tenant.fair_share_weight == 3
    rotated = c.post(f"/api/v1/keys/{child}/rotate", {}, format="json")
    assert rotated.status_code in (200, 201), rotated.content
    assert rotated.json()["priority_tier"] == 2  # a rotation keeps the tier
