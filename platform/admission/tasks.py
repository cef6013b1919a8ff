"""Celery tasks of the admission app."""

from __future__ import annotations

from celery import shared_task

from .services import admission_policies_publish_all


@shared_task(name="admission.republish_limits", ignore_result=True)
def republish_limits() -> int:
    """Republish every model's admission limits to Redis (beat, every ``ADMISSION_REPUBLISH_S``)."""
    return admission_policies_publish_all()
