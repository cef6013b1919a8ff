from django.apps import AppConfig


class UsageConfig(AppConfig):
    """Per-request usage records, written in batches from a Redis stream."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "usage"
