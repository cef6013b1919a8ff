"""Base class of the management commands that change audited rows (``audit.context``)."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from .context import AuditActor, audit_actor


class AuditedCommand(BaseCommand):
    """A ``BaseCommand`` whose changes are logged with ``source="command"`` and the command's name."""

    def execute(self, *args, **options):
        name = type(self).__module__.rsplit(".", 1)[-1]
        with audit_actor(AuditActor(source="command", command=name)):
            return super().execute(*args, **options)
