"""Admin pages load; adding a key through the admin shows its secret exactly once; revoke action."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from registry.models import ServedModel
from tenancy.models import ApiKey, Tenant
from tenancy.selectors import api_key_authenticate
from tenancy.services import api_key_create

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.control.control_urls")]


@pytest.fixture
def admin_client_logged(client, django_user_model):
    user = django_user_model.objects.create_superuser("root", "root@example.com", "pw-not-used")
    client.force_login(user)
    return client


@pytest.mark.parametrize(
    "app_model", ["registry_servedmodel", "tenancy_tenant", "tenancy_apikey", "usage_usagerecord"]
)
def test_changelists_load(admin_client_logged, app_model):
    response = admin_client_logged.get(reverse(f"admin:{app_model}_changelist"))
    assert response.status_code == 200


@pytest.mark.parametrize("app_model", ["registry_servedmodel", "tenancy_tenant", "tenancy_apikey"])
def test_add_pages_load(admin_client_logged, app_model):
    assert admin_client_logged.get(reverse(f"admin:{app_model}_add")).status_code == 200


def test_usage_admin_is_read_only(admin_client_logged):
    assert admin_client_logged.get(reverse("admin:usage_usagerecord_add")).status_code == 403


def test_add_key_in_admin_shows_secret_once(admin_client_logged):
    tenant = Tenant.objects.create(name="acme")
    add_page = admin_client_logged.get(reverse("admin:tenancy_apikey_add")).content.decode()
    assert 'name="secret' not in add_page and 'name="prefix"' not in add_page  # no secret field
    response = admin_client_logged.post(
        reverse("admin:tenancy_apikey_add"),
        {"tenant": tenant.pk, "name": "from-admin", "allowed_models": "m1, m2", "scopes": "inference",
         "expires_at_0": "", "expires_at_1": ""},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    shown_page = admin_client_logged.get(response["Location"])  # the page the admin redirects to
    assert shown_page.status_code == 200
    html = shown_page.content.decode()
    secrets_shown = re.findall(r"sk-[A-Za-z0-9]{8}\.[A-Za-z0-9_-]{43}", html)
    assert len(secrets_shown) == 1, html[:3000]
    plaintext = secrets_shown[0]
    auth = api_key_authenticate(plaintext)
    assert auth is not None and auth.tenant_name == "acme" and auth.allowed_models == ("m1", "m2")
    api_key = ApiKey.objects.get()
    assert api_key.name == "from-admin"
    # shown once: later pages (changelist again, change form) never contain it
    for url in (response["Location"], reverse("admin:tenancy_apikey_change", args=[api_key.pk])):
        page = admin_client_logged.get(url)
        assert page.status_code == 200
        assert plaintext.split(".", 1)[1] not in page.content.decode()


def test_revoke_action(admin_client_logged):
    tenant = Tenant.objects.create(name="acme")
    api_key, plaintext = api_key_create(tenant=tenant, name="k")
    response = admin_client_logged.post(
        reverse("admin:tenancy_apikey_changelist"),
        {"action": "revoke_keys", "_selected_action": [api_key.pk]},
    )
    assert response.status_code == 302
    assert api_key_authenticate(plaintext) is None
    assert ApiKey.objects.get(pk=api_key.pk).revoked_at is not None


def test_add_served_model_in_admin_reads_config(admin_client_logged, model_dir, tmp_path):
    data = {
        "served_model_name": "qwen3-tiny", "task": "generate", "enabled": "on", "model_dir": str(model_dir),
        "tokenizer_dir": "", "max_model_len": "", "max_num_seqs": "32", "num_replicas": "1", "backend": "native", "dtype": "auto", "device": "cpu",
        "chat_template": "",
    }
    response = admin_client_logged.post(reverse("admin:registry_servedmodel_add"), data)
    assert response.status_code == 302, response.content.decode()[:3000]
    assert ServedModel.objects.get().max_model_len == 40960
    bad = dict(data, served_model_name="other", model_dir=str(tmp_path))
    response = admin_client_logged.post(reverse("admin:registry_servedmodel_add"), bad)
    assert response.status_code == 200 and "config.json" in response.content.decode()
    assert ServedModel.objects.count() == 1
