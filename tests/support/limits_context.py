"""The caller's context for the key-limit tests: what ``tenancy.limits.limits_acquire`` reads of an ``AuthContext``
(``tenancy.limits.LimitsContext``), shared by ``tests/tenancy/test_limits.py`` and the processes it starts."""

from __future__ import annotations

from dataclasses import dataclass

from tenancy.limits import UNLIMITED, Limits


@dataclass
class Ctx:
    """A key (``key_id``, ``key_limits``) of a tenant (``tenant_id``, ``tenant_limits``); unlimited by default."""

    key_id: int
    tenant_id: int
    key_limits: Limits = UNLIMITED
    tenant_limits: Limits = UNLIMITED
