"""Issue 14 follow-up: the per-tenant key cap holds when an expired key is brought back; the usage data of
another tenant's key answers 404 saying so."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from tests.support.api_client import bearer_client
from tenancy.models import ApiKey, Tenant
from tenancy.services import KeyPermissionDenied, api_key_create, api_key_revoke, api_key_update

pytestmark = pytest.mark.django_db


def test_reactivating_an_expired_key_counts_against_the_cap(tenant, settings):
    settings.MAX_API_KEYS_PER_TENANT = 2
    _, admin_secret = api_key_create(tenant=tenant, name="tenant-admin", scopes=["inference", "keys:write"])
    past = timezone.now() - timedelta(seconds=1)
    gone = [api_key_create(tenant=tenant, name=f"gone-{i}", expires_at=past)[0] for i in range(2)]  # not counted
    c = bearer_client(admin_secret)
    assert c.post("/api/v1/keys", {"name": "b"}, format="json").status_code == 201  # the cap (2) is reached
    for body in ({"expires_at": None}, {"expires_at": (timezone.now() + timedelta(hours=1)).isoformat()}):
        r = c.patch(f"/api/v1/keys/{gone[0].pk}", body, format="json")
        assert r.status_code == 403, r.content
        assert r.json()["error"]["code"] == "api_key_limit_reached"
    gone[0].refresh_from_db()
    assert gone[0].expires_at is not None and gone[0].expires_at <= timezone.now()  # still expired
    with pytest.raises(KeyPermissionDenied, match="2 active API keys"):
        api_key_update(api_key=gone[1], expires_at=None)  # an operator's tool too
    # edits that keep it inactive, and any edit of an active key, are not capped
    assert c.patch(f"/api/v1/keys/{gone[0].pk}", {"name": "renamed"}, format="json").status_code == 200
    api_key_update(api_key=gone[1], expires_at=past - timedelta(days=1))
    # a revoked key stays inactive whatever its expiry: no slot needed
    api_key_revoke(api_key=gone[1])
    api_key_update(api_key=ApiKey.objects.get(pk=gone[1].pk), expires_at=None)
    # a free slot lets an expired key come back
    b = ApiKey.objects.get(tenant=tenant, name="b")
    api_key_revoke(api_key=b)
    r = c.patch(f"/api/v1/keys/{gone[0].pk}", {"expires_at": None}, format="json")
    assert r.status_code == 200, r.content


def test_usage_data_of_another_tenants_key_says_so(tenant):
    User = get_user_model()
    owner = User.objects.create_user("owner", password="pw-owner-1")
    mine = Tenant.objects.create(name="mine", owner=owner)
    other_key, _ = api_key_create(tenant=tenant, name="theirs")
    own_key, _ = api_key_create(tenant=mine, name="ours")
    client = Client()
    client.force_login(owner)
    r = client.get(f"/usage/data?api_key_id={other_key.pk}")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "api_key_id" and "not one of this tenant's" in err["message"]
    assert "Unknown route" not in err["message"]
    assert client.get(f"/usage/data?api_key_id={own_key.pk}").status_code == 200
