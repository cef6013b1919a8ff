from django.apps import AppConfig


class StoredResponsesConfig(AppConfig):
    """The Responses API's stored responses: each tenant's responses with their input and output items, kept for
    the tenant's retention and purged by beat (``stored_responses.purge_expired``, ``CELERY_BEAT_SCHEDULE``)."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "stored_responses"
    verbose_name = "Stored responses"
