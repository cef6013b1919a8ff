from django.apps import AppConfig


class TenancyConfig(AppConfig):
    """Tenants and their API keys."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "tenancy"
    verbose_name = "Tenants and API keys"

    def ready(self) -> None:
        from django.db.models.signals import post_delete, post_save

        # In ready(): models cannot be imported while the app registry is being filled.
        from .invalidation import on_api_key_changed, on_tenant_changed
        from .models import ApiKey, Tenant

        for signal, name in ((post_save, "save"), (post_delete, "delete")):
            signal.connect(on_api_key_changed, sender=ApiKey, dispatch_uid=f"tenancy-invalidate-key-{name}")
            signal.connect(on_tenant_changed, sender=Tenant, dispatch_uid=f"tenancy-invalidate-tenant-{name}")
