from django.apps import AppConfig
from django.conf import settings


class AdmissionConfig(AppConfig):
    """Admission control: per-model queue limits published to Redis, live state in the admin."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "admission"
    verbose_name = "Admission control"

    def ready(self) -> None:
        from django.db.models.signals import post_delete, post_save

        # In ready(): models cannot be imported while the app registry is being filled.
        from .models import AdmissionPolicy
        from .services import on_policy_deleted, on_policy_saved

        post_save.connect(on_policy_saved, sender=AdmissionPolicy, dispatch_uid="admission-publish-save")
        post_delete.connect(on_policy_deleted, sender=AdmissionPolicy, dispatch_uid="admission-publish-delete")
        try:  # in ready(), not at the top: Celery is optional for management commands
            from config.celery import app as celery_app
        except Exception:  # noqa: BLE001 - Celery is optional for management commands
            return
        # Runs on `usage`, the queue of the worker that writes usage (ops serve, harness/live_platform.py).
        celery_app.conf.beat_schedule.setdefault("admission-republish-limits", {
            "task": "admission.republish_limits",
            "schedule": settings.ADMISSION_REPUBLISH_S,
            "options": {"queue": "usage", "expires": settings.ADMISSION_REPUBLISH_S},
        })
