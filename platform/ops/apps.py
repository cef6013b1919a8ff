from django.apps import AppConfig


class OpsConfig(AppConfig):
    """Process supervision (``manage.py serve``) and first-run bootstrap."""

    name = "ops"
    default_auto_field = "django.db.models.BigAutoField"
