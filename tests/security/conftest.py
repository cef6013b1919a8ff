"""Fixtures shared by the security tests (a test module's own fixture of the same name wins)."""

from __future__ import annotations

import pytest


@pytest.fixture
def tenant():
    """A tenant named ``acme`` in the test database (needs ``django_db``)."""
    from tenancy.models import Tenant

    return Tenant.objects.create(name="acme")
