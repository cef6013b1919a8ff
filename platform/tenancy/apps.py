from django.apps import AppConfig


class TenancyConfig(AppConfig):
    """Tenants and their API keys."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "tenancy"
    verbose_name = "Tenants and API keys"
