"""``manage.py create_api_key --tenant NAME --name NAME [--models a,b] [--scopes s,t] [--expires-at ISO]``."""

from __future__ import annotations

import datetime as dt

from django.core.management.base import CommandError
from django.utils.dateparse import parse_datetime
from django.utils import timezone

from audit.commands import AuditedCommand
from tenancy.services import KeyRuleError, api_key_create, api_key_name_validate, tenant_get_or_create


def _csv(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [item.strip() for item in value.split(",") if item.strip()]


class Command(AuditedCommand):
    help = "Create an API key (and the tenant if missing). Prints the secret once on stdout; details on stderr."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True)
        parser.add_argument("--name", required=True)
        parser.add_argument("--models", default=None, help="comma-separated allowed served model names (default all)")
        parser.add_argument("--scopes", default=None, help="comma-separated scopes (default inference)")
        parser.add_argument("--expires-at", default=None, help="ISO-8601 datetime (UTC when no offset)")

    def handle(self, *args, **options):
        expires_at = None
        if options["expires_at"]:
            expires_at = parse_datetime(options["expires_at"])
            if expires_at is None:
                raise CommandError(f"--expires-at: not an ISO-8601 datetime: {options['expires_at']}")
            if timezone.is_naive(expires_at):
                expires_at = timezone.make_aware(expires_at, dt.timezone.utc)
        try:
            api_key_name_validate(options["name"])  # before the tenant is created
        except KeyRuleError as exc:
            raise CommandError(str(exc)) from exc
        tenant = tenant_get_or_create(name=options["tenant"])
        try:
            api_key, plaintext = api_key_create(
                tenant=tenant,
                name=options["name"],
                allowed_models=_csv(options["models"]),
                scopes=_csv(options["scopes"]),
                expires_at=expires_at,
            )
        except (ValueError, KeyRuleError) as exc:
            raise CommandError(str(exc)) from exc
        self.stderr.write(
            f"created key {api_key.prefix} for tenant {tenant.name!r}: scopes={api_key.scopes} "
            f"allowed_models={api_key.allowed_models or 'all'} expires_at={api_key.expires_at}"
        )
        self.stdout.write(plaintext)
