from django.apps import AppConfig


class RegistryConfig(AppConfig):
    """Model registry: which served models exist, where their files are, how they are served."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "registry"
    verbose_name = "Model registry"
