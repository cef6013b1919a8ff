"""Issue 14: client input on the Django/DRF routes (usage API, keys API, dashboards) answers 4xx, never 500.

Bad values answer 400 in the OpenAI error envelope naming the parameter; ids too large for the database
(``99999999999999999999``), non-ASCII digits (``"²".isdigit()`` is true in Python), impossible dates
(``2026-13-45T99:00``: ``parse_datetime`` raises) and NULs are refused before any query.
"""

from __future__ import annotations

import base64

import pytest
from django.test import Client

from tenancy.models import Tenant
from tenancy.services import api_key_create
from usage.selectors import MAX_POINTS

pytestmark = pytest.mark.django_db

HUGE = "99999999999999999999"


@pytest.fixture
def owner(django_user_model):
    """A staff superuser owning a tenant with one key; ``(client logged in, tenant, key)``."""
    user = django_user_model.objects.create_superuser("owner", "o@example.com", "pw-owner-123")
    tenant = Tenant.objects.create(name="acme", owner=user)
    api_key, _ = api_key_create(tenant=tenant, name="k")
    client = Client(raise_request_exception=False)
    client.force_login(user)
    return client, tenant, api_key


def _error(response, status: int, param: str | None):
    assert response.status_code == status, (response.status_code, response.content[:500])
    body = response.json()
    assert set(body) == {"error"} and body["error"]["param"] == param, body
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("query,param", [
    ("start=notadate", "start"),
    ("start=2026-13-45T99:00", "start"),
    ("end=2026-02-30T10:00:00Z", "end"),
    ("start=2026-01-01T25:61", "start"),
    ("granularity=week", "granularity"),
    ("range=year", "range"),
    ("group_by=tenant", "group_by"),
    (f"api_key_id={HUGE}", "api_key_id"),
    ("api_key_id=%C2%B2", "api_key_id"),  # "²"
    ("api_key_id=-1", "api_key_id"),
    ("model=a%00b", "model"),
    ("tenant=%C2%B2", "tenant"),
])
def test_usage_api_bad_query_is_400(owner, query, param):
    client, _, _ = owner
    _error(client.get(f"/api/v1/usage?{query}"), 400, param)


@pytest.mark.parametrize("query,status,param", [
    ("limit=0", 400, "limit"), ("limit=201", 400, "limit"), ("limit=abc", 400, "limit"), ("limit=", 400, "limit"),
    ("api_key_id=", 400, "api_key_id"), ("granularity=", 400, "granularity"), ("end=", 400, "end"),
    # a cursor whose position is no entry id (base64 of "p=abc"): DRF would pass the text to the id filter (500)
    (f"cursor={base64.b64encode(b'p=abc').decode()}", 404, None),
])
def test_empty_or_out_of_range_query_values_are_refused(owner, query, status, param):
    client, _, _ = owner
    path = "/api/v1/usage" if query.split("=")[0] in ("granularity", "end") else "/api/v1/audit"
    _error(client.get(f"{path}?{query}"), status, param)


def test_usage_api_still_answers_good_queries(owner):
    client, _, api_key = owner
    # every schema-valid date-time is answered (D-178): years past the bounds are taken as the bounds, an empty
    # range has no points, a long one is cut to its last MAX_POINTS buckets
    for query in ("", "range=day", "start=2026-01-01T00:00&end=2026-01-02T00:00&granularity=hour",
                  f"api_key_id={api_key.pk}&group_by=key", "end=0001-01-01T00:00:00Z",
                  "start=9999-12-31T23:59:00Z&end=9999-12-31T23:59:59Z&granularity=minute",
                  "start=0001-01-01T00:00:00Z&end=9999-12-31T23:59:59Z&granularity=minute",
                  "start=2026-01-02T00:00:00Z&end=2026-01-01T00:00:00Z"):
        r = client.get(f"/api/v1/usage?{query}")
        assert r.status_code == 200, (query, r.content[:300])
    cut = client.get("/api/v1/usage?start=0001-01-01T00:00:00Z&end=2026-01-01T00:00:00Z&granularity=minute").json()
    assert len(cut["points"]) == MAX_POINTS - 1 and cut["end"] == "2026-01-01T00:00:00Z"
    assert cut["points"][-1]["t"] == "2025-12-31T23:59:00Z"
    assert client.get("/api/v1/usage?start=2026-01-02T00:00:00Z&end=2026-01-01T00:00:00Z").json()["points"] == []
    r = client.get(f"/api/v1/usage?tenant={HUGE}")  # no such tenant of this user
    assert r.status_code == 403


@pytest.mark.parametrize("path,param", [
    (f"/usage/data?api_key_id={HUGE}", "api_key_id"),
    ("/usage/data?api_key_id=%C2%B2", "api_key_id"),
    (f"/usage/data?tenant={HUGE}", "tenant"),
    ("/usage/data?tenant=%C2%B2", "tenant"),
    ("/usage/data?range=year", "range"),
    ("/usage/data?model=a%00b", "model"),
    (f"/usage/?api_key_id={HUGE}", "api_key_id"),
    ("/usage/?tenant=%C2%B2", "tenant"),
    (f"/admin/usage-data?api_key_id={HUGE}", "api_key_id"),
    (f"/admin/usage-data?tenant={HUGE}", "tenant"),
    ("/admin/usage-data?tenant=%C2%B2", "tenant"),
    ("/admin/usage-data?range=year", "range"),
    (f"/admin/usage/usagerollup/?api_key_id={HUGE}", "api_key_id"),
])
def test_dashboards_bad_query_is_400(owner, path, param):
    client, _, _ = owner
    _error(client.get(path), 400, param)


@pytest.mark.parametrize("field,value", [
    ("rpm_limit", 10**30), ("tpm_limit", 2**31), ("max_concurrent_requests", 2**40), ("token_budget", 2**63),
])
def test_keys_api_out_of_range_limits_are_400(owner, field, value):
    client, _, api_key = owner
    r = client.post("/api/v1/keys", {"name": "big", field: value}, content_type="application/json")
    _error(r, 400, field)
    r = client.patch(f"/api/v1/keys/{api_key.pk}", {field: value}, content_type="application/json")
    _error(r, 400, field)


def test_keys_api_huge_ids_are_404(owner):
    client, _, _ = owner
    assert client.get(f"/api/v1/keys/{HUGE}").status_code == 404
    assert client.post(f"/api/v1/keys/{HUGE}/revoke").status_code == 404
    assert client.get(f"/api/v1/keys?tenant={HUGE}").status_code == 403
    _error(client.get("/api/v1/keys?tenant=%C2%B2"), 400, "tenant")
