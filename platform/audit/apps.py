from django.apps import AppConfig


class AuditConfig(AppConfig):
    """Audit log of control-plane changes (django-auditlog's ``LogEntry``): who, from where, which operation."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "audit"
    verbose_name = "Audit"

    def ready(self) -> None:
        from django.db.models.signals import pre_save

        # In ready(): auditlog's LogEntry model cannot be imported while the app registry is being filled.
        from auditlog.models import LogEntry

        from .context import on_log_entry_pre_save

        pre_save.connect(on_log_entry_pre_save, sender=LogEntry, dispatch_uid="audit-actor")
