"""Tenancy writes: tenants and API keys.

Key format: ``sk-<8 alphanumerics>.<43 url-safe base64 chars>`` (32 random bytes). The part before the
dot is the lookup ``prefix``; the stored hash is hex HMAC-SHA256(``settings.API_KEY_PEPPER``, full key).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
from datetime import datetime

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


def api_key_create(
    *,
    tenant: Tenant,
    name: str,
    allowed_models: list[str] | None = None,
    scopes: list[str] | None = None,
    expires_at: datetime | None = None,
) -> tuple[ApiKey, str]:
    """Create a key for ``tenant``; returns ``(api_key, plaintext)``.

    The plaintext is returned once and never stored. ``allowed_models`` None/empty = every model;
    ``scopes`` None = ``["inference"]``. Raises ``ValueError`` for malformed lists.
    """
    allowed = _str_list(allowed_models, "allowed_models")
    scope_list = _str_list(scopes, "scopes") if scopes is not None else ["inference"]
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
