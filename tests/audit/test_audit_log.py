"""The audit log (django-auditlog + audit.context): every change to tenants, keys, limits, served models and
admission policies, by the REST API, the admin and management commands, leaves an entry with who, when and the
fields before and after; secrets never reach an entry; a tenant sees its own keys' entries only."""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pytest
from auditlog.models import LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from admission.models import AdmissionPolicy
from registry.models import ServedModel
from tenancy.models import ApiKey, Tenant
from tenancy.services import api_key_create

pytestmark = pytest.mark.django_db


FAIRNESS_DEFAULTS = {"fair_share_threshold_pct": "50", "high_tier_reserve_pct": "0", "low_tier_ceiling_pct": "75"}

def _client(secret: str | None = None) -> APIClient:
    client = APIClient()
    if secret:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


def _entries(obj) -> list[LogEntry]:
    """The entries about ``obj``, oldest first."""
    return list(LogEntry.objects.filter(content_type=ContentType.objects.get_for_model(type(obj)),
                                        object_id=obj.pk).order_by("id"))


def _last(obj) -> LogEntry:
    return _entries(obj)[-1]


def _all_entries_text() -> str:
    """Every stored entry, every column, as one text (to search for secrets)."""
    rows = LogEntry.objects.values()
    return json.dumps(list(rows), default=str)


@pytest.fixture
def tenant():
    return Tenant.objects.create(name="acme", rpm_limit=100)


@pytest.fixture
def writer(tenant):
    api_key, plaintext = api_key_create(tenant=tenant, name="writer",
                                        scopes=["inference", "keys:write", "usage:read"])
    return api_key, plaintext


@pytest.fixture
def operator(django_user_model, client):
    user = django_user_model.objects.create_superuser("root", "root@example.com", "pw-root-Secret-123")
    client.force_login(user)
    return user, client


# --------------------------------------------------------------------------------------------- REST API
def test_rest_create_update_revoke_rotate_leave_entries_naming_the_key(tenant, writer):
    writer_key, writer_secret = writer
    c = _client(writer_secret)
    r = c.post("/api/v1/keys", {"name": "ci", "scopes": ["inference"], "rpm_limit": 5}, format="json",
               REMOTE_ADDR="127.0.0.9")
    assert r.status_code == 201, r.content
    new_id, new_secret = r.json()["id"], r.json()["key"]
    key = ApiKey.objects.get(pk=new_id)
    created = _last(key)
    assert created.action == LogEntry.Action.CREATE
    assert created.additional_data == {"source": "rest", "operation": "create",
                                       "api_key": {"id": writer_key.pk, "prefix": writer_key.prefix}}
    assert created.actor_id is None and created.remote_addr == "127.0.0.9"
    assert created.changes_dict["rpm_limit"] == [None, 5] and created.changes_dict["name"] == [None, "ci"]
    assert "secret_hash" not in created.changes_dict

    r = c.patch(f"/api/v1/keys/{new_id}", {"rpm_limit": 7, "tpm_limit": 900, "name": "ci-2"}, format="json")
    assert r.status_code == 200, r.content
    changed = _last(key)
    assert changed.action == LogEntry.Action.UPDATE and changed.additional_data["operation"] == "update"
    assert changed.changes_dict == {"rpm_limit": [5, 7], "tpm_limit": [None, 900], "name": ["ci", "ci-2"]}

    r = c.post(f"/api/v1/keys/{new_id}/rotate", {"grace_period_s": 60}, format="json")
    assert r.status_code == 201, r.content
    successor = ApiKey.objects.get(pk=r.json()["id"])
    rotated = _last(key)
    assert rotated.additional_data["operation"] == "rotate"
    assert rotated.changes_dict["replaced_by"] == [None, successor.pk]
    assert rotated.changes_dict["expires_at"][0] is None and rotated.changes_dict["expires_at"][1]
    assert _last(successor).additional_data["operation"] == "rotate"  # the successor's creation, same operation
    assert _last(successor).action == LogEntry.Action.CREATE

    r = c.delete(f"/api/v1/keys/{successor.pk}")
    assert r.status_code == 200, r.content
    revoked = _last(successor)
    assert revoked.additional_data["operation"] == "revoke"
    assert list(revoked.changes_dict) == ["revoked_at"] and revoked.changes_dict["revoked_at"][0] is None
    count = len(_entries(successor))
    assert c.post(f"/api/v1/keys/{successor.pk}/revoke").status_code == 200  # idempotent: no second entry
    assert len(_entries(successor)) == count

    # rotation without grace: the old key revoked at once, then pointed at its successor
    third = c.post("/api/v1/keys", {"name": "third", "scopes": ["inference"]}, format="json").json()
    r = c.post(f"/api/v1/keys/{third['id']}/rotate", {"grace_period_s": 0}, format="json")
    assert r.status_code == 201
    ops = [(e.additional_data["operation"], sorted(e.changes_dict)) for e in _entries(ApiKey.objects.get(pk=third["id"]))]
    assert ops[1:] == [("rotate", ["revoked_at"]), ("rotate", ["replaced_by"])]

    text = _all_entries_text()
    for secret in (writer_secret, new_secret, third["key"], r.json()["key"]):
        assert secret not in text and secret.split(".", 1)[1] not in text
    for stored_hash in ApiKey.objects.values_list("secret_hash", flat=True):
        assert stored_hash not in text


def test_rest_session_of_the_owner_is_named(tenant, django_user_model):
    owner = django_user_model.objects.create_user("alice", password="pw-Alice-Secret-1")
    tenant.owner = owner
    tenant.save()
    c = APIClient()
    c.force_login(owner)
    r = c.post("/api/v1/keys", {"name": "by-owner", "scopes": ["inference"]}, format="json")
    assert r.status_code == 201, r.content
    entry = _last(ApiKey.objects.get(pk=r.json()["id"]))
    assert entry.actor_id == owner.pk and entry.additional_data["source"] == "rest"
    listing = c.get("/api/v1/audit").json()["results"]
    assert listing[0]["actor"] == {"type": "tenant_owner", "username": "alice"}


# ------------------------------------------------------------------------------------------------ admin
def test_admin_changes_leave_entries_naming_the_user(tenant, operator, model_dir):
    user, client = operator
    r = client.post(reverse("admin:tenancy_apikey_add"),
                    {"tenant": tenant.pk, "name": "from-admin", "allowed_models": "m1", "scopes": "inference",
                     "expires_at_0": "", "expires_at_1": ""})
    assert r.status_code == 302, r.content.decode()[:2000]
    key = ApiKey.objects.get(name="from-admin")
    created = _last(key)
    assert created.action == LogEntry.Action.CREATE and created.actor_id == user.pk
    assert created.additional_data["source"] == "admin" and created.additional_data["operation"] == "create"

    r = client.post(reverse("admin:tenancy_apikey_change", args=[key.pk]),
                    {"name": "from-admin", "allowed_models": "m1, m2", "scopes": "inference", "expires_at_0": "",
                     "expires_at_1": "", "rpm_limit": "3", "tpm_limit": "", "max_concurrent_requests": "",
                     "token_budget": "", "budget_period": "month"})
    assert r.status_code == 302, r.content.decode()[:3000]
    edited = _last(key)
    assert edited.actor_id == user.pk and edited.additional_data["source"] == "admin"
    assert edited.changes_dict["rpm_limit"] == [None, 3]
    assert edited.changes_dict["allowed_models"] == [["m1"], ["m1", "m2"]]

    r = client.post(reverse("admin:tenancy_apikey_changelist"), {"action": "revoke_keys", "_selected_action": [key.pk]})
    assert r.status_code == 302
    revoked = _last(key)
    assert revoked.actor_id == user.pk and revoked.additional_data["operation"] == "revoke"
    assert list(revoked.changes_dict) == ["revoked_at"]

    r = client.post(reverse("admin:tenancy_tenant_change", args=[tenant.pk]),
                    {"name": "acme", "is_active": "on", "owner": "", "cache_group": "", "rpm_limit": "50",
                     "tpm_limit": "1000", "max_concurrent_requests": "", "token_budget": "", "budget_period": "month",
                     "priority_tier": str(tenant.priority_tier), "fair_share_weight": "1",
                     "api_keys-TOTAL_FORMS": "0", "api_keys-INITIAL_FORMS": "0", "api_keys-MIN_NUM_FORMS": "0",
                     "api_keys-MAX_NUM_FORMS": "1000"})
    assert r.status_code == 302, r.content.decode()[:3000]
    tenant_entry = _last(tenant)
    assert tenant_entry.actor_id == user.pk
    assert tenant_entry.changes_dict == {"rpm_limit": [100, 50], "tpm_limit": [None, 1000]}

    data = {"served_model_name": "m1", "task": "generate", "enabled": "on", "model_dir": str(model_dir),
            "tokenizer_dir": "", "max_model_len": "", "max_num_seqs": "32", "num_replicas": "1", "backend": "native", "dtype": "auto", "device": "cpu",
            "chat_template": ""}
    assert client.post(reverse("admin:registry_servedmodel_add"), data).status_code == 302
    sm = ServedModel.objects.get(served_model_name="m1")
    r = client.post(reverse("admin:registry_servedmodel_change", args=[sm.pk]), dict(data, max_num_seqs="8"))
    assert r.status_code == 302, r.content.decode()[:3000]
    assert _last(sm).changes_dict == {"max_num_seqs": [32, 8]} and _last(sm).actor_id == user.pk

    r = client.post(reverse("admin:admission_admissionpolicy_add"),
                    {"served_model": sm.pk, "max_num_queued_reqs": "4", "max_num_queued_tokens": "",
                     "target_ttft_ms": "2000", **FAIRNESS_DEFAULTS})
    assert r.status_code == 302, r.content.decode()[:3000]
    policy = AdmissionPolicy.objects.get()
    r = client.post(reverse("admin:admission_admissionpolicy_change", args=[policy.pk]),
                    {"max_num_queued_reqs": "2", "max_num_queued_tokens": "64", "target_ttft_ms": "2000",
                     **FAIRNESS_DEFAULTS})
    assert r.status_code == 302, r.content.decode()[:3000]
    assert _last(policy).changes_dict == {"max_num_queued_reqs": [4, 2], "max_num_queued_tokens": [None, 64]}
    assert _last(policy).actor_id == user.pk and _last(policy).additional_data["source"] == "admin"

    text = _all_entries_text()
    assert user.password not in text and "pw-root-Secret-123" not in text
    assert key.secret_hash not in text


def test_admin_shows_the_log_read_only(tenant, operator, writer):
    user, client = operator
    writer_key, writer_secret = writer
    r = _client(writer_secret).post("/api/v1/keys", {"name": "via-rest", "scopes": ["inference"]}, format="json")
    assert r.status_code == 201
    page = client.get(reverse("admin:auditlog_logentry_changelist"))
    assert page.status_code == 200
    html = page.content.decode()
    assert r.json()["prefix"] in html and f"API key {writer_key.prefix} (id {writer_key.pk})" in html
    assert client.get(reverse("admin:auditlog_logentry_changelist"), {"source": "rest"}).status_code == 200
    entry = _last(writer_key)
    detail = client.get(reverse("admin:auditlog_logentry_change", args=[entry.pk]))
    assert detail.status_code == 200
    assert client.get(reverse("admin:auditlog_logentry_add")).status_code == 403
    r = client.post(reverse("admin:auditlog_logentry_change", args=[entry.pk]), {"action": "2"})
    assert r.status_code == 403
    r = client.post(reverse("admin:auditlog_logentry_delete", args=[entry.pk]), {"post": "yes"})
    assert r.status_code == 403
    assert LogEntry.objects.filter(pk=entry.pk).exists()


# ------------------------------------------------------------------------------------- management commands
def test_commands_leave_entries(model_dir):
    out = io.StringIO()
    call_command("create_api_key", "--tenant", "cmd-tenant", "--name", "k1", stdout=out, stderr=io.StringIO())
    secret = out.getvalue().strip()
    key = ApiKey.objects.get(name="k1")
    entry = _last(key)
    assert entry.additional_data == {"source": "command", "command": "create_api_key", "operation": "create"}
    assert _last(Tenant.objects.get(name="cmd-tenant")).additional_data["command"] == "create_api_key"
    call_command("register_model", "m2", str(model_dir), "--max-num-seqs", "4", stdout=io.StringIO())
    sm = ServedModel.objects.get(served_model_name="m2")
    assert _last(sm).action == LogEntry.Action.CREATE and _last(sm).additional_data["command"] == "register_model"
    call_command("register_model", "m2", str(model_dir), "--max-num-seqs", "6", stdout=io.StringIO())
    assert _last(sm).changes_dict == {"max_num_seqs": [4, 6]}
    call_command("admission_policy", "m2", "--max-num-queued-reqs", "3", stdout=io.StringIO())
    policy = AdmissionPolicy.objects.get(served_model=sm)
    assert _last(policy).changes_dict == {"max_num_queued_reqs": [None, 3]}
    assert _last(policy).additional_data["command"] == "admission_policy"
    text = _all_entries_text()
    assert secret not in text and key.secret_hash not in text


# ------------------------------------------------------------------------------------ the tenant's view
def test_tenant_sees_its_own_keys_entries_only_paginated(tenant, writer):
    writer_key, writer_secret = writer
    other = Tenant.objects.create(name="other")
    other_key, other_secret = api_key_create(tenant=other, name="theirs", scopes=["inference", "keys:write"])
    c = _client(writer_secret)
    for i in range(4):
        assert c.post("/api/v1/keys", {"name": f"k{i}", "scopes": ["inference"]}, format="json").status_code == 201
    _client(other_secret).post("/api/v1/keys", {"name": "other-new", "scopes": ["inference"]}, format="json")
    other.rpm_limit = 1
    other.save()

    r = c.get("/api/v1/audit", {"limit": 2})
    assert r.status_code == 200, r.content
    body = r.json()
    assert len(body["results"]) == 2 and body["next"] and body["previous"] is None
    seen, url = [], "/api/v1/audit?limit=2"
    while url:
        page = c.get(url).json()
        seen += page["results"]
        url = page["next"]
    own_ids = set(ApiKey.objects.filter(tenant=tenant).values_list("pk", flat=True))
    assert {e["api_key_id"] for e in seen} == own_ids
    assert len(seen) == len({e["id"] for e in seen}) == 5  # the writer's creation + 4, each once
    assert [e["id"] for e in seen] == sorted((e["id"] for e in seen), reverse=True)
    made_by_key = [e for e in seen if e["api_key"].startswith("sk-") and e["operation"] == "create"
                   and e["source"] == "rest"]
    assert len(made_by_key) == 4
    assert made_by_key[0]["actor"] == {"type": "api_key", "api_key_id": writer_key.pk,
                                       "api_key_prefix": writer_key.prefix}
    assert made_by_key[0]["changes"]["scopes"] == {"before": None, "after": ["inference"]}
    text = json.dumps(seen)
    assert other_key.prefix not in text and "other-new" not in text and "theirs" not in text

    one = c.get("/api/v1/audit", {"api_key_id": writer_key.pk}).json()["results"]
    assert [e["api_key_id"] for e in one] == [writer_key.pk]
    assert one[0]["actor"] == {"type": "system"}  # made by the fixture, outside any request or command
    r = c.get("/api/v1/audit", {"api_key_id": other_key.pk})
    assert r.status_code == 404 and r.json()["error"]["param"] == "api_key_id"
    assert c.get("/api/v1/audit", {"api_key_id": "x"}).status_code == 400
    # the other tenant sees only its own
    theirs = _client(other_secret).get("/api/v1/audit").json()["results"]
    assert {e["api_key_id"] for e in theirs} == set(ApiKey.objects.filter(tenant=other).values_list("pk", flat=True))


def test_tenant_view_names_no_operator(tenant, writer, operator):
    _, writer_secret = writer
    user, client = operator
    key, _ = api_key_create(tenant=tenant, name="victim")
    client.post(reverse("admin:tenancy_apikey_changelist"), {"action": "revoke_keys", "_selected_action": [key.pk]})
    entries = _client(writer_secret).get("/api/v1/audit", {"api_key_id": key.pk}).json()["results"]
    assert entries[0]["operation"] == "revoke" and entries[0]["source"] == "admin"
    assert entries[0]["actor"] == {"type": "operator"}
    assert "root" not in json.dumps(entries)


def test_scope_and_credentials(tenant, writer):
    _, inference_only = api_key_create(tenant=tenant, name="inf")
    r = _client(inference_only).get("/api/v1/audit")
    assert r.status_code == 403 and "keys:write" in r.json()["error"]["message"]
    assert _client().get("/api/v1/audit").status_code == 401
    revoked, secret = api_key_create(tenant=tenant, name="gone", scopes=["inference", "keys:write"])
    revoked.revoked_at = timezone.now() - timedelta(seconds=1)
    revoked.save()
    assert _client(secret).get("/api/v1/audit").status_code == 401


def test_schema_documents_the_endpoint(tenant, writer):
    _, writer_secret = writer
    r = _client(writer_secret).get("/api/v1/schema", {"format": "json"})
    assert r.status_code == 200
    schema = json.loads(r.content)
    op = schema["paths"]["/api/v1/audit"]["get"]
    names = {p["name"] for p in op["parameters"]}
    assert {"api_key_id", "cursor", "limit"} <= names
    ref = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    page = schema["components"]["schemas"][ref]
    assert {"next", "previous", "results"} <= set(page["properties"])
    entry = schema["components"]["schemas"]["AuditEntry"]["properties"]
    assert {"actor", "changes", "operation", "timestamp", "api_key_id"} <= set(entry)
