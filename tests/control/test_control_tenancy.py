"""API keys: create, authenticate, revoke, expire, pepper, never stored in plaintext, command, DRF class."""

from __future__ import annotations

import hashlib
import hmac
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone
from rest_framework import exceptions
from rest_framework.test import APIRequestFactory

from tenancy.authentication import ApiKeyAuthentication, ApiKeyPrincipal
from tenancy.models import ApiKey, Tenant
from tenancy.selectors import AuthContext, api_key_authenticate
from tenancy.services import api_key_create, api_key_revoke

pytestmark = pytest.mark.django_db


@pytest.fixture
def tenant():
    return Tenant.objects.create(name="acme")


def test_create_and_authenticate(tenant):
    api_key, plaintext = api_key_create(tenant=tenant, name="ci", allowed_models=["qwen3-tiny"])
    prefix, dot, rest = plaintext.partition(".")
    assert dot and prefix == api_key.prefix and prefix.startswith("sk-") and len(prefix) == 11
    assert len(rest) == 43
    auth = api_key_authenticate(plaintext)
    assert isinstance(auth, AuthContext)
    assert (auth.key_id, auth.key_prefix, auth.tenant_id, auth.tenant_name) == (
        api_key.pk, api_key.prefix, tenant.pk, "acme")
    assert auth.allowed_models == ("qwen3-tiny",) and auth.scopes == ("inference",)
    assert auth.allows_model("qwen3-tiny") and not auth.allows_model("other")
    assert auth.has_scope("inference") and not auth.has_scope("operator")
    with pytest.raises(AttributeError):  # frozen: safe to share from a per-process cache
        auth.tenant_id = 5
    # two keys never share a prefix or a secret
    other, other_plain = api_key_create(tenant=tenant, name="ci2", scopes=["inference", "operator"])
    assert other.prefix != api_key.prefix and other_plain != plaintext
    assert api_key_authenticate(other_plain).scopes == ("inference", "operator")
    assert api_key_authenticate(other_plain).allows_model("anything")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s[:-1] + ("A" if s[-1] != "A" else "B"),  # right prefix, wrong secret
        lambda s: s.split(".")[0],                           # prefix only
        lambda s: "sk-ZZZZZZZZ." + s.split(".")[1],          # unknown prefix
        lambda s: s.upper(),
        lambda s: "",
        lambda s: s + "x" * 300,                              # oversized
        lambda s: "Bearer " + s,
    ],
)
def test_bad_secrets_are_refused(tenant, mutate):
    _api_key, plaintext = api_key_create(tenant=tenant, name="k")
    assert api_key_authenticate(plaintext) is not None
    assert api_key_authenticate(mutate(plaintext)) is None


def test_revoke(tenant):
    api_key, plaintext = api_key_create(tenant=tenant, name="k")
    api_key_revoke(api_key=api_key)
    first = ApiKey.objects.get(pk=api_key.pk).revoked_at
    assert first is not None
    assert api_key_authenticate(plaintext) is None
    api_key_revoke(api_key=api_key)  # idempotent
    assert ApiKey.objects.get(pk=api_key.pk).revoked_at == first


def test_expiry_and_inactive_tenant(tenant):
    _k1, past = api_key_create(tenant=tenant, name="old", expires_at=timezone.now() - timedelta(seconds=1))
    _k2, future = api_key_create(tenant=tenant, name="new", expires_at=timezone.now() + timedelta(hours=1))
    assert api_key_authenticate(past) is None
    auth = api_key_authenticate(future)
    assert auth is not None and not auth.is_expired()
    assert auth.is_expired(now=timezone.now() + timedelta(hours=2))
    Tenant.objects.filter(pk=tenant.pk).update(is_active=False)
    assert api_key_authenticate(future) is None


def test_secret_never_stored(tenant, settings):
    api_key, plaintext = api_key_create(tenant=tenant, name="k")
    secret_part = plaintext.split(".", 1)[1]
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {ApiKey._meta.db_table} WHERE id = %s", [api_key.pk])
        row = cursor.fetchone()
    assert row is not None
    for cell in row:
        assert secret_part not in str(cell) and plaintext not in str(cell)
    # what is stored is the peppered HMAC of the full key
    expected = hmac.new(settings.API_KEY_PEPPER.encode(), plaintext.encode(), hashlib.sha256).hexdigest()
    assert api_key.secret_hash == expected
    assert api_key.secret_hash != hashlib.sha256(plaintext.encode()).hexdigest()
    # another pepper: the same key no longer authenticates
    settings.API_KEY_PEPPER = "another-pepper"
    assert api_key_authenticate(plaintext) is None


def test_create_api_key_command_creates_tenant_and_prints_secret_once():
    out, err = StringIO(), StringIO()
    call_command("create_api_key", "--tenant", "newco", "--name", "cli", "--models", "a,b",
                 "--scopes", "inference,operator", stdout=out, stderr=err)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert len(lines) == 1
    auth = api_key_authenticate(lines[0])
    assert auth is not None and auth.tenant_name == "newco"
    assert auth.allowed_models == ("a", "b") and auth.scopes == ("inference", "operator")
    assert lines[0] not in err.getvalue() and auth.key_prefix in err.getvalue()
    assert Tenant.objects.filter(name="newco").count() == 1


def test_drf_authentication(tenant):
    api_key, plaintext = api_key_create(tenant=tenant, name="k")
    factory = APIRequestFactory()
    auth_class = ApiKeyAuthentication()
    user, ctx = auth_class.authenticate(factory.get("/", HTTP_AUTHORIZATION=f"Bearer {plaintext}"))
    assert isinstance(user, ApiKeyPrincipal) and user.is_authenticated
    assert ctx.key_id == api_key.pk and user.tenant_id == tenant.pk
    assert auth_class.authenticate(factory.get("/")) is None
    with pytest.raises(exceptions.AuthenticationFailed):
        auth_class.authenticate(factory.get("/", HTTP_AUTHORIZATION=f"Bearer {plaintext}x"))
    assert auth_class.authenticate_header(None) == "Bearer"
