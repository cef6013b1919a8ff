"""Stored responses: reads (docs/ARCHITECTURE.md §10). Every read names the tenant; an expired response is not found
even before beat purges it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.utils import timezone

from .models import ResponseRetention, StoredResponse, StoredResponseItem


class ChainBrokenError(Exception):
    """An earlier response of a chain was deleted or has expired: the conversation cannot be rebuilt."""

    def __init__(self, missing: str):
        super().__init__(f"response {missing} of this conversation was deleted or has expired")
        self.missing = missing


@dataclass(frozen=True)
class Chain:
    """A stored response as a follow-up's context: ``tip`` (the response named by ``previous_response_id``),
    ``ids`` (the chain's response ids, oldest first, ``tip`` last) and ``items`` (each response's input items, then
    its output items, in chain order)."""

    tip: StoredResponse
    ids: list[str]
    items: list[dict[str, Any]]


def response_retention_days(*, tenant_id: int) -> int:
    """Days the tenant's stored responses are kept: its ``ResponseRetention``, else
    ``settings.RESPONSES_RETENTION_DAYS``."""
    days = ResponseRetention.objects.filter(tenant_id=tenant_id).values_list("retention_days", flat=True).first()
    return int(days) if days is not None else int(settings.RESPONSES_RETENTION_DAYS)


def stored_response_get(*, tenant_id: int, response_id: str) -> StoredResponse | None:
    """The tenant's unexpired response ``response_id``, or None (none, another tenant's, or expired)."""
    return StoredResponse.objects.filter(tenant_id=tenant_id, response_id=response_id,
                                         expires_at__gt=timezone.now()).first()


def stored_response_job(*, response_id: str) -> StoredResponse | None:
    """The response ``response_id`` whoever's it is: for the background runner, which runs what the api stored."""
    return StoredResponse.objects.filter(response_id=response_id).first()


def stored_response_output(*, response: StoredResponse) -> list[dict[str, Any]]:
    """The response's output items, in order."""
    return [row.data for row in StoredResponseItem.objects.filter(response=response, direction="out")
            .order_by("position").only("data")]


def stored_response_chain(*, tenant_id: int, response_id: str) -> Chain | None:
    """The context a follow-up of the tenant's ``response_id`` continues (``Chain``); None when the tenant has no
    such unexpired response. Raises ``ChainBrokenError`` when an earlier response of its chain is gone."""
    tip = stored_response_get(tenant_id=tenant_id, response_id=response_id)
    if tip is None:
        return None
    ids = [*tip.ancestors, tip.response_id]
    rows = dict(StoredResponse.objects.filter(tenant_id=tenant_id, response_id__in=ids,
                                              expires_at__gt=timezone.now()).values_list("response_id", "pk"))
    for rid in ids:
        if rid not in rows:
            raise ChainBrokenError(rid)
    order = {rows[rid]: i for i, rid in enumerate(ids)}
    items = sorted(StoredResponseItem.objects.filter(response_id__in=list(order)).values_list(
        "response_id", "direction", "position", "data"), key=lambda r: (order[r[0]], r[1], r[2]))
    return Chain(tip, ids, [data for _pk, _d, _p, data in items])


def stored_items_by_ids(*, tenant_id: int, item_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{item id: item}`` of the tenant's unexpired stored items among ``item_ids`` (for ``item_reference``; an id
    stored twice, e.g. an output fed back as input, gives its latest copy)."""
    rows = StoredResponseItem.objects.filter(item_id__in=list(item_ids), response__tenant_id=tenant_id,
                                             response__expires_at__gt=timezone.now()).order_by("pk")
    return {row.item_id: row.data for row in rows.only("item_id", "data")}


def stored_input_items_page(*, response: StoredResponse, after: str | None, before: str | None, limit: int,
                            order: str) -> tuple[list[dict[str, Any]], bool] | None:
    """A page of ``response``'s input items (``GET .../input_items``): in ``order`` (``asc``: as sent, ``desc``:
    newest first), those after the item ``after`` and before the item ``before`` (ids), at most ``limit``, and
    whether more follow. None when ``after`` or ``before`` is not one of its input items."""
    rows = list(StoredResponseItem.objects.filter(response=response, direction="in").order_by("position")
                .values_list("item_id", "data"))
    if order == "desc":
        rows.reverse()
    ids = [item_id for item_id, _data in rows]
    start, end = 0, len(rows)
    if after is not None:
        if after not in ids:
            return None
        start = ids.index(after) + 1
    if before is not None:
        if before not in ids:
            return None
        end = ids.index(before)
    window = rows[start:max(start, end)]
    return [data for _id, data in window[:limit]], len(window) > limit
