from django.apps import AppConfig


class GatewayConfig(AppConfig):
    """Django app config of ``gateway``."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "gateway"
