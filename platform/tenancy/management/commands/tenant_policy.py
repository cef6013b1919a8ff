"""``manage.py tenant_policy TENANT [--priority-tier high|standard|low] [--fair-share-weight N]``: set a tenant's
priority tier and fair-share weight (the tenant is created when missing); prints ``tenant NAME id=N ...``."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError

from audit.commands import AuditedCommand
from tenancy.models import PRIORITY_TIER_CHOICES
from tenancy.services import tenant_get_or_create, tenant_priority_update

TIERS = {name: value for value, name in PRIORITY_TIER_CHOICES}


class Command(AuditedCommand):
    help = "Set a tenant's admission priority tier and fair-share weight (in force at once on every api process)."

    def add_arguments(self, parser):
        parser.add_argument("tenant")
        parser.add_argument("--priority-tier", choices=[*TIERS, *(str(v) for v in TIERS.values())], default=None)
        parser.add_argument("--fair-share-weight", type=int, default=None)

    def handle(self, *args, **opts):
        tenant = tenant_get_or_create(name=opts["tenant"])
        tier = opts["priority_tier"]
        value = None if tier is None else (int(tier) if tier.isdigit() else TIERS[tier])
        try:
            tenant_priority_update(tenant=tenant, priority_tier=value, fair_share_weight=opts["fair_share_weight"])
        except ValidationError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"tenant {tenant.name} id={tenant.pk} priority_tier={tenant.priority_tier} "
                          f"fair_share_weight={tenant.fair_share_weight}")
