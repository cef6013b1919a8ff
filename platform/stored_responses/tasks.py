"""Celery tasks of the stored responses (queue ``usage``; scheduled by beat, ``apps.StoredResponsesConfig.ready``)."""

from __future__ import annotations

from celery import shared_task

from .services import stored_responses_purge_expired


@shared_task(name="stored_responses.purge_expired", acks_late=True, ignore_result=True)
def purge_expired() -> int:
    """Delete the stored responses whose retention has passed, with their items; returns how many."""
    return stored_responses_purge_expired()
