"""Issue 17: where ``/usage/`` takes a logged-in user who owns no tenant.

An operator (``usage.web.can_view_all_tenants``) is redirected to the operator dashboard with the same query;
anyone else gets a styled page (``page.css``, under the CSP) saying the account owns no tenant, with 403.
Django's test client against the real URLconf and database.
"""

from __future__ import annotations

import pytest
from django.test import Client

from tenancy.models import Tenant

pytestmark = pytest.mark.django_db


def _client(user) -> Client:
    client = Client(raise_request_exception=False)
    client.force_login(user)
    return client


def test_operator_without_a_tenant_is_taken_to_the_operator_dashboard(django_user_model):
    root = django_user_model.objects.create_superuser("root", "r@example.com", "pw-root-123")
    client = _client(root)
    r = client.get("/usage/?range=day")
    assert r.status_code == 302
    assert r["Location"] == "/admin/usage/usagerollup/?range=day"
    page = client.get(r["Location"])
    assert page.status_code == 200
    assert b'id="usage-dash"' in page.content and b'data-operator="1"' in page.content
    assert client.get("/usage/")["Location"] == "/admin/usage/usagerollup/"


def test_user_without_a_tenant_gets_a_styled_page(django_user_model):
    user = django_user_model.objects.create_user("nobody", password="pw-nobody-123")
    r = _client(user).get("/usage/")
    assert r.status_code == 403
    assert r["Content-Type"].startswith("text/html")
    html = r.content.decode()
    assert html.startswith("<!doctype html>") and "/static/usage/page.css" in html
    assert 'id="usage-no-tenant"' in html and "owns no active tenant" in html
    assert "<style" not in html and "<script" not in html  # CSP: nothing inline


def test_staff_without_the_permission_and_without_a_tenant_is_not_redirected(django_user_model):
    staff = django_user_model.objects.create_user("staff", password="pw-staff-123", is_staff=True)
    assert _client(staff).get("/usage/").status_code == 403


def test_an_operator_owning_a_tenant_still_sees_that_tenant(django_user_model):
    root = django_user_model.objects.create_superuser("root", "r@example.com", "pw-root-123")
    Tenant.objects.create(name="acme", owner=root)
    r = _client(root).get("/usage/")
    assert r.status_code == 200 and b'data-operator="0"' in r.content
