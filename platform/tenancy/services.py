"""Tenancy writes: tenants and API keys.

Key format: ``sk-<8 alphanumerics>.<43 url-safe base64 chars>`` (32 random bytes). The part before the
dot is the lookup ``prefix``; the stored hash is hex HMAC-SHA256(``settings.API_KEY_PEPPER``, full key).

Rules every caller gets (the REST API, the admin, ``manage.py create_api_key``): key names match
``API_KEY_NAME_RE``; a tenant holds at most ``settings.MAX_API_KEYS_PER_TENANT`` active keys; a rotated key's
expiry (its grace period) only ever moves earlier; a rotated key is not rotated again.

Rules of a tenant-side ``KeyActor`` (the REST API passes one; operators' tools pass none): it never touches a
key holding an operator scope (``SCOPES_OPERATOR``) nor grants one; an acting *key* never changes or rotates
itself (it may revoke itself) and never creates, changes, rotates or revokes a key wider than itself
(``key_wider_than``: models, expiry, limits, scopes), so a leaked narrow key cannot revoke the tenant's wider
keys; the tenant owner's login revokes any of the tenant's keys. Breaking one raises ``KeyPermissionDenied`` (403) or ``KeyRequestInvalid``
(400), both carrying ``param`` and ``code``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import string
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from audit.context import audit_operation

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


def tenant_priority_update(*, tenant: Tenant, priority_tier: int | None = None,
                           fair_share_weight: int | None = None) -> Tenant:
    """Set the tenant's priority tier (0 high, 1 standard, 2 low) and/or fair-share weight (1..1000); an operator's
    action (never the tenant's). In force in every api process at once (the save invalidates its keys' cached
    ``AuthContext``s, ``tenancy.invalidation``). Raises ``django.core.exceptions.ValidationError`` for bad values."""
    if priority_tier is not None:
        tenant.priority_tier = priority_tier
    if fair_share_weight is not None:
        tenant.fair_share_weight = fair_share_weight
    tenant.full_clean(validate_unique=False)
    tenant.save(update_fields=["priority_tier", "fair_share_weight"])
    return tenant


class KeyRuleError(Exception):
    """A key change that breaks a rule. ``param``: the field at fault (or None); ``code``: machine-readable."""

    status = 400

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class KeyRequestInvalid(KeyRuleError, ValueError):
    """The request itself is invalid (HTTP 400, ``invalid_request_error``)."""

    status = 400


class KeyPermissionDenied(KeyRuleError, PermissionError):
    """The caller may not make this change (HTTP 403, ``permission_error``)."""

    status = 403


@dataclass(frozen=True)
class KeyActor:
    """Who changes keys through a tenant-facing surface (the REST API).

    ``tenant_id``: the tenant acted for. ``key``: the acting ``ApiKey`` (a ``keys:write`` key), whose own
    scopes, models, expiry and limits bound what it may create, change or rotate; None for the tenant owner's
    session, bounded only by the tenant-wide rules (no operator scopes, grace periods, the key cap).
    """

    tenant_id: int
    key: ApiKey | None = None


# Safe key names (defence in depth for every place a name is shown): ASCII letters, digits, space and -_.:@/()
API_KEY_NAME_MAX_LEN = 100
API_KEY_NAME_RE = re.compile(rf"\A[A-Za-z0-9 _\-.:@/()]{{1,{API_KEY_NAME_MAX_LEN}}}\Z")  # anchored: validators search
API_KEY_NAME_RULE = (f"1 to {API_KEY_NAME_MAX_LEN} characters among ASCII letters, digits, space and "
                     "- _ . : @ / ( ), not only spaces")


def api_key_name_validate(name) -> str:
    """Return ``name`` when it is a safe key name (``API_KEY_NAME_RE``, not blank); raises ``KeyRequestInvalid``
    (``param="name"``) otherwise."""
    if not isinstance(name, str) or not API_KEY_NAME_RE.fullmatch(name) or not name.strip():
        raise KeyRequestInvalid(f"name must be {API_KEY_NAME_RULE}", param="name", code="invalid_name")
    return name


def _str_list(values, field: str) -> list[str]:
    if values is None:
        return []
    if isinstance(values, str) or not all(isinstance(v, str) and v.strip() for v in values):
        raise ValueError(f"{field} must be a list of non-empty strings")
    return list(dict.fromkeys(v.strip() for v in values))


# ``priority_tier`` (0 high, 1 standard, 2 low; None = the tenant's) travels with the limits: a key can only lower
# its tenant's tier (``ApiKey.effective_priority_tier``), and a tenant-side caller only set a tier no better than
# the acting key's (``key_wider_than``).
LIMIT_FIELDS = ("rpm_limit", "tpm_limit", "max_concurrent_requests", "token_budget", "budget_period", "priority_tier")
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
        elif name == "priority_tier":
            if value is not None and (isinstance(value, bool) or value not in (0, 1, 2)):
                raise ValueError("priority_tier must be 0 (high), 1 (standard), 2 (low) or null (the tenant's)")
        elif value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be a non-negative integer or null")
    if not values.get("budget_period"):
        values.pop("budget_period", None)
    return values


_PERIOD_DAYS = {"day": 1, "week": 7, "month": 28}  # a month is at least 28 days


def key_wider_than(actor: ApiKey, *, scopes, allowed_models, expires_at, limits: dict) -> tuple[str, str] | None:
    """First way a key with these settings would be wider than ``actor``, as ``(param, message)``, or None.

    Wider means: a scope the actor lacks; a model outside the actor's ``allowed_models`` (or every model when
    the actor has a list); no expiry or a later one than the actor's; any of ``rpm_limit``, ``tpm_limit``,
    ``max_concurrent_requests``, ``token_budget`` unset or higher where the actor has it; a ``priority_tier``
    unset or better (smaller) than the actor's where the actor has one; with a token budget,
    a shorter ``budget_period`` (the same budget per day is looser than per week). ``limits`` maps
    ``LIMIT_FIELDS`` to values (missing = unset).
    """
    extra = [s for s in scopes if s not in (actor.scopes or [])]
    if extra:
        return "scopes", f"scope {extra[0]!r} is not held by the acting API key"
    if actor.allowed_models:
        if not allowed_models:
            return "allowed_models", "the acting API key is limited to some models: list them (a subset of its own)"
        outside = [m for m in allowed_models if m not in actor.allowed_models]
        if outside:
            return "allowed_models", f"model {outside[0]!r} is not allowed for the acting API key"
    if actor.expires_at is not None and (expires_at is None or expires_at > actor.expires_at):
        return "expires_at", f"must be set and no later than the acting API key's expiry ({actor.expires_at.isoformat()})"
    for field in ("rpm_limit", "tpm_limit", "max_concurrent_requests", "token_budget"):
        mine, theirs = getattr(actor, field), limits.get(field)
        if mine is not None and (theirs is None or theirs > mine):
            return field, f"must be set and at most {mine}, the acting API key's {field}"
    if actor.priority_tier is not None:
        theirs = limits.get("priority_tier")
        if theirs is None or theirs < actor.priority_tier:
            return "priority_tier", (f"must be set and at least {actor.priority_tier}, the acting API key's tier "
                                     "(a larger number is a lower priority)")
    if actor.token_budget is not None:
        mine = _PERIOD_DAYS[actor.budget_period or "month"]
        if _PERIOD_DAYS[limits.get("budget_period") or "month"] < mine:
            return "budget_period", (f"must be {actor.budget_period or 'month'} or longer, as the acting API key's "
                                     "budget is")
    return None


def _actor_check_target(actor: KeyActor | None, api_key: ApiKey, action: str) -> None:
    """Tenant-side rules on the key acted upon (see the module docstring); ``action`` names it in messages."""
    if actor is None:
        return
    if api_key.tenant_id != actor.tenant_id:
        raise KeyPermissionDenied("This API key belongs to another tenant.", code="wrong_tenant")
    operator = [s for s in (api_key.scopes or []) if s in SCOPES_OPERATOR]
    if operator:
        raise KeyPermissionDenied(f"A key with the operator scope {operator[0]!r} can only be managed by an operator.",
                                  code="operator_key")
    if actor.key is not None and actor.key.pk == api_key.pk and action != "revoke":
        raise KeyPermissionDenied(f"An API key cannot {action} itself; use another key with 'keys:write' or the "
                                  "tenant owner's login (a key may revoke itself).", code="self_change")


def _actor_check_result(actor: KeyActor | None, *, scopes, allowed_models, expires_at, limits: dict,
                        why: str = "a key cannot grant more than it holds") -> None:
    """Tenant-side rules on the settings a key would have (or has, for a revocation): no operator scope; no
    wider than an acting key (``why`` ends the refusal's message)."""
    if actor is None:
        return
    operator = [s for s in scopes if s in SCOPES_OPERATOR]
    if operator:
        raise KeyPermissionDenied(f"scope {operator[0]!r} is for operators only", param="scopes",
                                  code="operator_scope")
    if actor.key is not None:
        wider = key_wider_than(actor.key, scopes=scopes, allowed_models=allowed_models, expires_at=expires_at,
                               limits=limits)
        if wider is not None:
            param, message = wider
            raise KeyPermissionDenied(f"{param}: {message} ({why})", param=param,
                                      code="wider_than_actor")


def api_keys_active_count(tenant_id: int) -> int:
    """How many of the tenant's keys are active (neither revoked nor expired): what the key cap counts."""
    now = timezone.now()
    return (ApiKey.objects.filter(tenant_id=tenant_id, revoked_at__isnull=True)
            .exclude(expires_at__lte=now).count())


def _cap_check(tenant_id: int) -> None:
    cap = getattr(settings, "MAX_API_KEYS_PER_TENANT", 1000)
    if api_keys_active_count(tenant_id) >= cap:
        raise KeyPermissionDenied(f"This tenant already has {cap} active API keys (MAX_API_KEYS_PER_TENANT); revoke "
                                  "one first.", code="api_key_limit_reached")


def api_key_create(
    *,
    tenant: Tenant,
    name: str,
    allowed_models: list[str] | None = None,
    scopes: list[str] | None = None,
    expires_at: datetime | None = None,
    limits: dict | None = None,
    actor: KeyActor | None = None,
    check_name: bool = True,
) -> tuple[ApiKey, str]:
    """Create a key for ``tenant``; returns ``(api_key, plaintext)``.

    The plaintext is returned once and never stored. ``allowed_models`` None/empty = every model;
    ``scopes`` None = ``["inference"]``; ``limits`` maps ``LIMIT_FIELDS`` names to values (None =
    unlimited). ``actor``: the tenant-side caller (None = an operator's tool); ``check_name`` False skips the
    name rule (rotation copies the old key's name). Raises ``ValueError`` (a
    ``KeyRequestInvalid`` for the name) for a bad name, malformed lists, unknown scopes (``SCOPES_TENANT`` +
    ``SCOPES_OPERATOR``) or unknown limit fields; ``KeyPermissionDenied`` when the tenant is at
    ``settings.MAX_API_KEYS_PER_TENANT`` active keys or ``actor`` may not create such a key.
    """
    if check_name:
        api_key_name_validate(name)
    limit_values = _limits_clean(limits)
    allowed = _str_list(allowed_models, "allowed_models")
    scope_list = _str_list(scopes, "scopes") if scopes is not None else ["inference"]
    unknown = [s for s in scope_list if s not in SCOPES_TENANT + SCOPES_OPERATOR]
    if unknown:
        raise ValueError(f"unknown scope {unknown[0]!r}; known: {', '.join(SCOPES_TENANT + SCOPES_OPERATOR)}")
    if actor is not None and actor.tenant_id != tenant.pk:
        raise KeyPermissionDenied("This tenant is not the caller's.", code="wrong_tenant")
    _actor_check_result(actor, scopes=scope_list, allowed_models=allowed, expires_at=expires_at, limits=limit_values)
    with audit_operation("create"):
        return _api_key_insert(tenant=tenant, name=name, allowed=allowed, scope_list=scope_list,
                               expires_at=expires_at, limit_values=limit_values)


def _api_key_insert(*, tenant: Tenant, name: str, allowed: list[str], scope_list: list[str],
                    expires_at: datetime | None, limit_values: dict) -> tuple[ApiKey, str]:
    """Insert a new key under the tenant's cap (``api_key_create`` after its checks); ``(api_key, plaintext)``."""
    for _attempt in range(5):  # prefix collisions (62**8 space) are rare; retry a few times
        prefix, plaintext = api_key_secret_generate()
        try:
            with transaction.atomic():
                # Serialize key creation per tenant (row lock on PostgreSQL; SQLite's BEGIN IMMEDIATE already does),
                # so concurrent creations cannot pass the cap together.
                Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
                _cap_check(tenant.pk)
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


def api_key_revoke(*, api_key: ApiKey, actor: KeyActor | None = None) -> ApiKey:
    """Revoke ``api_key`` now (idempotent: an already revoked key keeps its first ``revoked_at``).

    ``actor``: the tenant-side caller (None = an operator's tool); raises ``KeyPermissionDenied`` when it may not
    (a key holding an operator scope; an acting key may revoke itself and the tenant's keys no wider than
    itself, ``key_wider_than``).
    """
    _actor_check_target(actor, api_key, "revoke")
    if actor is not None and actor.key is not None and actor.key.pk != api_key.pk:
        _actor_check_result(actor, scopes=api_key.scopes or [], allowed_models=api_key.allowed_models or [],
                            expires_at=api_key.expires_at, limits={f: getattr(api_key, f) for f in LIMIT_FIELDS},
                            why="a key cannot revoke a key wider than itself; the tenant owner's login can")
    with audit_operation("revoke"), transaction.atomic():
        row = ApiKey.objects.select_for_update().get(pk=api_key.pk)
        if row.revoked_at is None:  # a save (not QuerySet.update): the audit log and the auth invalidation see it
            row.revoked_at = timezone.now()
            row.save(update_fields=["revoked_at"])
    api_key.revoked_at = row.revoked_at
    return api_key


def api_key_update(*, api_key: ApiKey, actor: KeyActor | None = None, **changes) -> ApiKey:
    """Change ``name``, ``allowed_models``, ``scopes``, ``expires_at`` or limit fields of ``api_key``.

    In force in every api process at once (``tenancy.invalidation``; within ``gateway.auth.AUTH_CACHE_TTL_S``,
    1 s, if the announcement is lost). ``actor``: the tenant-side
    caller (None = an operator's tool). Raises ``ValueError`` for unknown fields or malformed values (a
    ``KeyRequestInvalid`` for the name); ``KeyPermissionDenied`` for a later or cleared expiry of a rotated key
    (its grace period), a change ``actor`` may not make (the key's resulting settings are checked whole), or an
    expiry that makes an expired key active again while the tenant is at ``settings.MAX_API_KEYS_PER_TENANT``
    active keys (``api_key_limit_reached``; a revoked key stays revoked whatever its expiry).
    """
    allowed = {"name", "allowed_models", "scopes", "expires_at", *LIMIT_FIELDS}
    unknown = set(changes) - allowed
    if unknown:
        raise ValueError(f"cannot change {sorted(unknown)}")
    _actor_check_target(actor, api_key, "change")
    if "name" in changes:
        api_key_name_validate(changes["name"])
    if "allowed_models" in changes:
        changes["allowed_models"] = _str_list(changes["allowed_models"], "allowed_models")
    if "scopes" in changes:
        changes["scopes"] = _str_list(changes["scopes"], "scopes")
    changes.update(_limits_clean({k: changes.pop(k) for k in list(changes) if k in LIMIT_FIELDS}))
    if "expires_at" in changes and api_key.replaced_by_id is not None and api_key.expires_at is not None:
        until = changes["expires_at"]
        if until is None or until > api_key.expires_at:
            raise KeyPermissionDenied("This key was rotated: its expiry (the grace period) can only move earlier.",
                                      param="expires_at", code="grace_period")
    after = {f: changes.get(f, getattr(api_key, f)) for f in ("scopes", "allowed_models", "expires_at", *LIMIT_FIELDS)}
    _actor_check_result(actor, scopes=after["scopes"] or [], allowed_models=after["allowed_models"] or [],
                        expires_at=after["expires_at"], limits={f: after[f] for f in LIMIT_FIELDS})
    with audit_operation("update"), transaction.atomic():
        if "expires_at" in changes:
            # Moving an expired key's expiry to the future (or clearing it) makes it active again: it counts
            # against the tenant's cap like a new key, under the same per-tenant lock as api_key_create.
            Tenant.objects.select_for_update().filter(pk=api_key.tenant_id).first()
            current = ApiKey.objects.filter(pk=api_key.pk).values("revoked_at", "expires_at").first()
            now = timezone.now()
            until = changes["expires_at"]
            was_active = current is not None and current["revoked_at"] is None and (
                current["expires_at"] is None or current["expires_at"] > now)
            if (current is not None and current["revoked_at"] is None and not was_active
                    and (until is None or until > now)):
                _cap_check(api_key.tenant_id)
        for name, value in changes.items():
            setattr(api_key, name, value)
        api_key.save(update_fields=list(changes) or None)
    return api_key


def api_key_rotate(*, api_key: ApiKey, grace_s: int = 0, actor: KeyActor | None = None) -> tuple[ApiKey, str]:
    """Replace ``api_key`` by a new key with the same name, models, scopes, limits and expiry.

    The old key keeps working for ``grace_s`` seconds (its ``expires_at`` becomes ``now + grace_s``, never
    later than it was), or is revoked at once when ``grace_s`` is 0; ``old.replaced_by`` = the new key.
    Returns ``(new_key, plaintext)`` (shown once). Raises ``ValueError`` for a revoked or already rotated key
    (rotate its successor) or ``grace_s < 0``; ``KeyPermissionDenied`` when ``actor`` may not (an operator-scoped
    key, the acting key itself, a key wider than the acting key) or the tenant is at its key cap.
    """
    if grace_s < 0:
        raise ValueError("grace_s must be >= 0")
    with audit_operation("rotate"), transaction.atomic():
        old = ApiKey.objects.select_for_update().get(pk=api_key.pk)
        if old.revoked_at is not None:
            raise KeyRequestInvalid("a revoked key cannot be rotated", code="revoked")
        _actor_check_target(actor, old, "rotate")
        if old.replaced_by_id is not None:
            raise KeyRequestInvalid("this key was already rotated; rotate its successor "
                                    f"(id {old.replaced_by_id}) instead", code="already_rotated")
        now = timezone.now()
        if grace_s == 0:  # revoked first, so a tenant at its key cap can still swap a key for a new one
            old.revoked_at = now
            old.save(update_fields=["revoked_at"])
        new, plaintext = api_key_create(
            tenant=old.tenant, name=old.name, allowed_models=old.allowed_models, scopes=old.scopes,
            expires_at=old.expires_at, limits={f: getattr(old, f) for f in LIMIT_FIELDS},
            actor=actor, check_name=False,  # a name stored before names were checked stays
        )
        old.replaced_by = new
        if grace_s != 0:
            until = now + timedelta(seconds=grace_s)
            old.expires_at = until if old.expires_at is None else min(old.expires_at, until)
        old.save(update_fields=["replaced_by", "expires_at"])
    api_key.refresh_from_db()
    return new, plaintext
