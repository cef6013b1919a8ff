"""Stored responses: writes (docs/ARCHITECTURE.md §10). Every write that names an existing response names its tenant
too, so a tenant can only ever change its own; status moves are compare-and-set, so a cancel and the end of the run
cannot both win."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from tenancy.models import Tenant

from .models import ResponseRetention, StoredResponse, StoredResponseItem
from .selectors import response_retention_days

UNFINISHED = ("queued", "in_progress")
PURGE_BATCH = 500


def _item_rows(response: StoredResponse, direction: str, items: Sequence[dict[str, Any]]) -> list[StoredResponseItem]:
    return [StoredResponseItem(response=response, direction=direction, position=i, item_id=str(item.get("id", "")),
                               item_type=str(item.get("type", "")), data=item) for i, item in enumerate(items)]


def stored_response_create(*, response_id: str, tenant_id: int, api_key_id: int | None, model: str, status: str,
                           created_at: datetime, input_items: Sequence[dict[str, Any]],
                           output_items: Sequence[dict[str, Any]] = (), background: bool = False,
                           previous_response_id: str | None = None, ancestors: Sequence[str] = (),
                           params: dict[str, Any] | None = None, metadata: dict[str, str] | None = None,
                           request: dict[str, Any] | None = None, usage: dict[str, Any] | None = None,
                           error: dict[str, Any] | None = None, incomplete_details: dict[str, Any] | None = None,
                           engine_id: str = "", prompt_tokens: int = 0,
                           completed_at: datetime | None = None) -> StoredResponse:
    """Store a response with its input items (and, for one that already ended, its output items), in one
    transaction. It expires after the tenant's retention (``response_retention_days``) from ``created_at``."""
    days = response_retention_days(tenant_id=tenant_id)
    with transaction.atomic():
        response = StoredResponse.objects.create(
            response_id=response_id, tenant_id=tenant_id, api_key_id=api_key_id, model=model, status=status,
            background=background, previous_response_id=previous_response_id or "", ancestors=list(ancestors),
            params=params or {}, metadata=metadata or {}, request=request, usage=usage, error=error,
            incomplete_details=incomplete_details, engine_id=engine_id, prompt_tokens=prompt_tokens,
            created_at=created_at, completed_at=completed_at, expires_at=created_at + timedelta(days=days))
        StoredResponseItem.objects.bulk_create(_item_rows(response, "in", input_items)
                                               + _item_rows(response, "out", output_items))
    return response


def stored_response_start(*, response_id: str) -> bool:
    """``queued`` → ``in_progress`` (a background runner took it up); False when it was no longer queued
    (cancelled, or another runner took it)."""
    return StoredResponse.objects.filter(response_id=response_id, status="queued").update(status="in_progress") == 1


def stored_response_finish(*, response_id: str, status: str, output_items: Sequence[dict[str, Any]],
                           usage: dict[str, Any] | None, error: dict[str, Any] | None = None,
                           incomplete_details: dict[str, Any] | None = None, engine_id: str = "",
                           prompt_tokens: int = 0, completed_at: datetime | None = None) -> str:
    """End a background response: its output items, usage and final ``status``, in one transaction. A response
    cancelled meanwhile stays ``cancelled`` (with what was generated before the abort). Returns the status it has."""
    with transaction.atomic():
        response = StoredResponse.objects.select_for_update().filter(response_id=response_id).first()
        if response is None:  # deleted meanwhile
            return "deleted"
        final = "cancelled" if response.status == "cancelled" else status
        StoredResponse.objects.filter(pk=response.pk).update(
            status=final, usage=usage, error=None if final == "cancelled" else error,
            incomplete_details=None if final == "cancelled" else incomplete_details, engine_id=engine_id,
            prompt_tokens=prompt_tokens, completed_at=completed_at or timezone.now(), request=None)
        StoredResponseItem.objects.filter(response=response, direction="out").delete()
        StoredResponseItem.objects.bulk_create(_item_rows(response, "out", output_items))
    return final


def stored_response_cancel(*, tenant_id: int, response_id: str) -> bool:
    """``queued``/``in_progress`` → ``cancelled`` for the tenant's background response; False when it is not
    unfinished (or not the tenant's, or not a background response)."""
    return StoredResponse.objects.filter(tenant_id=tenant_id, response_id=response_id, background=True,
                                         status__in=UNFINISHED).update(status="cancelled") == 1


def stored_response_delete(*, tenant_id: int, response_id: str) -> bool:
    """Delete the tenant's response and its items; False when it has none of that id."""
    with transaction.atomic():
        pk = StoredResponse.objects.filter(tenant_id=tenant_id, response_id=response_id).values_list("pk", flat=True)
        ids = list(pk)
        if not ids:
            return False
        StoredResponseItem.objects.filter(response_id__in=ids).delete()
        StoredResponse.objects.filter(pk__in=ids).delete()
    return True


def stored_responses_purge_expired(*, now: datetime | None = None, batch: int = PURGE_BATCH,
                                   max_batches: int = 100) -> int:
    """Delete the responses whose ``expires_at`` passed, with their items, ``batch`` at a time; returns how many."""
    now = now or timezone.now()
    total = 0
    for _ in range(max_batches):
        ids = list(StoredResponse.objects.filter(expires_at__lte=now).values_list("pk", flat=True)[:batch])
        if not ids:
            break
        with transaction.atomic():
            StoredResponseItem.objects.filter(response_id__in=ids).delete()
            total += StoredResponse.objects.filter(pk__in=ids).delete()[0]
    return total


def response_retention_set(*, tenant: Tenant, retention_days: int | None) -> ResponseRetention | None:
    """Set how long ``tenant``'s stored responses are kept (``None``: the settings default). Responses already
    stored keep their ``expires_at``."""
    if retention_days is None:
        ResponseRetention.objects.filter(tenant=tenant).delete()
        return None
    row, _created = ResponseRetention.objects.update_or_create(tenant=tenant,
                                                               defaults={"retention_days": retention_days})
    row.full_clean()
    return row
