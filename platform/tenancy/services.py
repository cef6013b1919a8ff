"""Tenancy writes: tenants and API keys.

Key format: ``sk-<8 alphanumerics>.<43 url-safe base64 chars>`` (32 random bytes). The part before the
dot is the lookup ``prefix``; the stored hash is hex HMAC-SHA256(``settings.API_KEY_PEPPER``, full key).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from .models import ApiKey, Tenant

API_KEY_PREFIX_LEAD = "sk-"
API_KEY_PREFIX_CHARS = 8
API_KEY_SECRET_BYTES = 32
_ALPHANUMERIC = string.ascii_letters + string.digits


def api_key_hash(secret: str) -> str:
    """Hex HMAC-SHA256 of ``secret`` keyed by ``settings.API_KEY_PEPPER`` (64 chars)."""
    return hmac.new(settings.API_KEY_PEPPER.encode(), secret.encode(), hashlib.sha256).hexdigest()


def api_key_secret_generate() -> tuple[str, str]:
    """New random ``(prefix, plaintext)``: prefix ``sk-XXXXXXXX``, plaintext ``prefix + "." + 43 chars``."""
    prefix = API_KEY_PREFIX_LEAD + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(API_KEY_PREFIX_CHARS))
    return prefix, f"{prefix}.{secrets.token_urlsafe(API_KEY_SECRET_BYTES)}"


def tenant_get_or_create(*, name: str) -> Tenant:
    """The tenant named ``name``, created (active, no owner) when missing."""
    tenant, _ = Tenant.objects.get_or_create(name=name)
    return tenant


def _str_list(values, field: str) -> list[str]:
    if values is None:
        return []
    if isinstance(values, str) or not all(isinstance(v, str) and v.strip() for v in values):
        raise ValueError(f"{field} must be a list of non-empty strings")
    return list(dict.fromkeys(v.strip() for v in values))


LIMIT_FIELDS = ("rpm_limit", "tpm_limit", "max_concurrent_requests", "token_budget", "budget_period")
SCOPES_TENANT = ("inference", "usage:read", "keys:write")
SCOPES_OPERATOR = ("metrics", "operator")


def _limits_clean(limits: dict | None) -> dict:
    values = dict(limits or {})
    unknown = set(values) - set(LIMIT_FIELDS)
    if unknown:
        raise ValueError(f"unknown limit fields: {sorted(unknown)}")
    for name, value in values.items():
        if name == "budget_period":
            if value not in (None, "", "day", "week", "month"):
                raise ValueError("budget_period must be day, week or month")
        elif value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be a non-negative integer or null")
    if not values.get("budget_period"):
        values.pop("budget_period", None)
    return values


def api_key_create(
    *,
    tenant: Tenant,
    name: str,
    allowed_models: list[str] | None = None,
    scopes: list[str] | None = None,
    expires_at: datetime | None = None,
    limits: dict | None = None,
) -> tuple[ApiKey, str]:
    """Create a key for ``tenant``; returns ``(api_key, plaintext)``.

    The plaintext is returned once and never stored. ``allowed_models`` None/empty = every model;
    ``scopes`` None = ``["inference"]``; ``limits`` maps ``LIMIT_FIELDS`` names to values (None =
    unlimited). Raises ``ValueError`` for malformed lists, unknown scopes (``SCOPES_TENANT`` +
    ``SCOPES_OPERATOR``) or unknown limit fields.
    """
    limit_values = _limits_clean(limits)
    allowed = _str_list(allowed_models, "allowed_models")
    scope_list = _str_list(scopes, "scopes") if scopes is not None else ["inference"]
    unknown = [s for s in scope_list if s not in SCOPES_TENANT + SCOPES_OPERATOR]
    if unknown:
        raise ValueError(f"unknown scope {unknown[0]!r}; known: {', '.join(SCOPES_TENANT + SCOPES_OPERATOR)}")
    for _attempt in range(5):  # prefix collisions (62**8 space) are rare; retry a few times
        prefix, plaintext = api_key_secret_generate()
        try:
            with transaction.atomic():
                api_key = ApiKey.objects.create(
                    tenant=tenant,
                    name=name,
                    prefix=prefix,
                    secret_hash=api_key_hash(plaintext),
                    allowed_models=allowed,
                    scopes=scope_list,
                    expires_at=expires_at,
                    **limit_values,
                )
            return api_key, plaintext
        except IntegrityError:
            if not ApiKey.objects.filter(prefix=prefix).exists():
                raise
    raise RuntimeError("could not allocate a unique API key prefix")


def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    """Revoke ``api_key`` now (idempotent: an already revoked key keeps its first ``revoked_at``)."""
    now = timezone.now()
    ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(revoked_at=now)
    api_key.refresh_from_db(fields=["revoked_at"])
    return api_key


def api_key_update(*, api_key: ApiKey, **changes) -> ApiKey:
    """Change ``name``, ``allowed_models``, ``scopes``, ``expires_at`` or limit fields of ``api_key``.

    In force in every api process within ``gateway.auth.AUTH_CACHE_TTL_S`` (1 s). Raises ``ValueError``
    for unknown fields or malformed values.
    """
    allowed = {"name", "allowed_models", "scopes", "expires_at", *LIMIT_FIELDS}
    unknown = set(changes) - allowed
    if unknown:
        raise ValueError(f"cannot change {sorted(unknown)}")
    if "allowed_models" in changes:
        changes["allowed_models"] = _str_list(changes["allowed_models"], "allowed_models")
    if "scopes" in changes:
        changes["scopes"] = _str_list(changes["scopes"], "scopes")
    changes.update(_limits_clean({k: changes.pop(k) for k in list(changes) if k in LIMIT_FIELDS}))
    for name, value in changes.items():
        setattr(api_key, name, value)
    api_key.save(update_fields=list(changes) or None)
    return api_key


def api_key_rotate(*, api_key: ApiKey, grace_s: int = 0) -> tuple[ApiKey, str]:
    """Replace ``api_key`` by a new key with the same name, models, scopes, limits and expiry.

    The old key keeps working for ``grace_s`` seconds (its ``expires_at`` becomes ``now + grace_s``, never
    later than it was), or is revoked at once when ``grace_s`` is 0; ``old.replaced_by`` = the new key.
    Returns ``(new_key, plaintext)`` (shown once). Raises ``ValueError`` for a revoked key or ``grace_s < 0``.
    """
    if grace_s < 0:
        raise ValueError("grace_s must be >= 0")
    with transaction.atomic():
        old = ApiKey.objects.select_for_update().get(pk=api_key.pk)
        if old.revoked_at is not None:
            raise ValueError("a revoked key cannot be rotated")
        new, plaintext = api_key_create(
            tenant=old.tenant, name=old.name, allowed_models=old.allowed_models, scopes=old.scopes,
            expires_at=old.expires_at, limits={f: getattr(old, f) for f in LIMIT_FIELDS},
        )
        now = timezone.now()
        old.replaced_by = new
        if grace_s == 0:
            old.revoked_at = now
        else:
            until = now + timedelta(seconds=grace_s)
            old.expires_at = until if old.expires_at is None else min(old.expires_at, until)
        old.save(update_fields=["replaced_by", "revoked_at", "expires_at"])
    api_key.refresh_from_db()
    return new, plaintext
