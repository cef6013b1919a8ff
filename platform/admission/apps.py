from django.apps import AppConfig


class AdmissionConfig(AppConfig):
    """Django app config of ``admission``."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "admission"
