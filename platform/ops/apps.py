from django.apps import AppConfig

from . import checks  # noqa: F401  (registers the deployment checks of manage.py check --deploy)


class OpsConfig(AppConfig):
    """Process supervision (``manage.py serve``) and first-run bootstrap."""

    name = "ops"
    default_auto_field = "django.db.models.BigAutoField"
