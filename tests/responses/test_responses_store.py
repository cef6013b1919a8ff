"""The stored responses app (platform/stored_responses): tenant ownership on every read and write, a chain's items in
order, item references, input-items pages, compare-and-set status moves, retention and the purge."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from stored_responses.models import StoredResponse, StoredResponseItem
from stored_responses.selectors import (ChainBrokenError, response_retention_days, stored_input_items_page,
                                        stored_items_by_ids, stored_response_chain, stored_response_get,
                                        stored_response_output)
from stored_responses.services import (response_retention_set, stored_response_cancel, stored_response_create,
                                       stored_response_delete, stored_response_finish, stored_response_start,
                                       stored_responses_purge_expired)
from stored_responses.tasks import purge_expired
from tenancy.models import Tenant

pytestmark = pytest.mark.django_db


def _msg(i: str, text: str, role: str = "user") -> dict:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"id": i, "type": "message", "role": role, "status": "completed", "content": [{"type": kind, "text": text}]}


def _store(tenant: Tenant, rid: str, inputs: list[dict], outputs: list[dict], ancestors: tuple = (),
           status: str = "completed", background: bool = False, **kw) -> StoredResponse:
    return stored_response_create(response_id=rid, tenant_id=tenant.pk, api_key_id=None, model="m", status=status,
                                  created_at=timezone.now(), input_items=inputs, output_items=outputs,
                                  ancestors=ancestors, previous_response_id=ancestors[-1] if ancestors else None,
                                  background=background, **kw)


@pytest.fixture
def tenants() -> tuple[Tenant, Tenant]:
    return Tenant.objects.create(name="resp-a"), Tenant.objects.create(name="resp-b")


def test_another_tenants_response_is_not_found(tenants) -> None:
    a, b = tenants
    _store(a, "resp_1", [_msg("in_1", "hi")], [_msg("msg_1", "hello", "assistant")])
    assert stored_response_get(tenant_id=a.pk, response_id="resp_1") is not None
    assert stored_response_get(tenant_id=b.pk, response_id="resp_1") is None
    assert stored_response_chain(tenant_id=b.pk, response_id="resp_1") is None
    assert stored_items_by_ids(tenant_id=b.pk, item_ids=["msg_1"]) == {}
    assert stored_response_delete(tenant_id=b.pk, response_id="resp_1") is False
    assert stored_response_cancel(tenant_id=b.pk, response_id="resp_1") is False
    assert StoredResponse.objects.filter(response_id="resp_1").exists()


def test_chain_items_in_order(tenants) -> None:
    a, _b = tenants
    _store(a, "resp_1", [_msg("in_1", "one")], [_msg("msg_1", "two", "assistant")])
    _store(a, "resp_2", [_msg("in_2", "three")], [_msg("msg_2", "four", "assistant")], ancestors=("resp_1",))
    chain = stored_response_chain(tenant_id=a.pk, response_id="resp_2")
    assert chain is not None and chain.ids == ["resp_1", "resp_2"]
    assert [i["content"][0]["text"] for i in chain.items] == ["one", "two", "three", "four"]
    assert stored_response_output(response=chain.tip) == [_msg("msg_2", "four", "assistant")]


def test_deleting_removes_the_items_and_breaks_the_chain(tenants) -> None:
    a, _b = tenants
    _store(a, "resp_1", [_msg("in_1", "one")], [_msg("msg_1", "two", "assistant")])
    _store(a, "resp_2", [_msg("in_2", "three")], [], ancestors=("resp_1",))
    assert stored_response_delete(tenant_id=a.pk, response_id="resp_1") is True
    assert not StoredResponseItem.objects.filter(item_id__in=["in_1", "msg_1"]).exists()
    with pytest.raises(ChainBrokenError) as err:
        stored_response_chain(tenant_id=a.pk, response_id="resp_2")
    assert err.value.missing == "resp_1"


def test_item_references_find_the_latest_copy(tenants) -> None:
    a, _b = tenants
    _store(a, "resp_1", [_msg("in_1", "old")], [])
    _store(a, "resp_2", [_msg("in_1", "new")], [])
    assert stored_items_by_ids(tenant_id=a.pk, item_ids=["in_1", "nope"]) == {"in_1": _msg("in_1", "new")}


def test_input_items_pages(tenants) -> None:
    a, _b = tenants
    resp = _store(a, "resp_1", [_msg(f"in_{i}", str(i)) for i in range(5)], [_msg("msg_x", "out", "assistant")])
    ids = lambda page: [i["id"] for i in page[0]]
    page = stored_input_items_page(response=resp, after=None, before=None, limit=2, order="desc")
    assert page is not None and ids(page) == ["in_4", "in_3"] and page[1] is True
    page = stored_input_items_page(response=resp, after="in_3", before=None, limit=2, order="desc")
    assert page is not None and ids(page) == ["in_2", "in_1"] and page[1] is True
    page = stored_input_items_page(response=resp, after="in_1", before=None, limit=20, order="asc")
    assert page is not None and ids(page) == ["in_2", "in_3", "in_4"] and page[1] is False
    page = stored_input_items_page(response=resp, after=None, before="in_2", limit=20, order="asc")
    assert page is not None and ids(page) == ["in_0", "in_1"]
    assert stored_input_items_page(response=resp, after="msg_x", before=None, limit=2, order="asc") is None


def test_cancel_and_finish_are_compare_and_set(tenants) -> None:
    a, _b = tenants
    _store(a, "resp_fg", [_msg("in_1", "x")], [])
    assert stored_response_cancel(tenant_id=a.pk, response_id="resp_fg") is False  # not a background response
    _store(a, "resp_bg", [_msg("in_2", "x")], [], status="queued", background=True, request={"model": "m"})
    assert stored_response_start(response_id="resp_bg") is True
    assert stored_response_start(response_id="resp_bg") is False
    assert stored_response_cancel(tenant_id=a.pk, response_id="resp_bg") is True
    assert stored_response_cancel(tenant_id=a.pk, response_id="resp_bg") is False
    final = stored_response_finish(response_id="resp_bg", status="completed", output_items=[_msg("m1", "so", "assistant")],
                                   usage={"input_tokens": 3, "output_tokens": 2})
    assert final == "cancelled"
    resp = StoredResponse.objects.get(response_id="resp_bg")
    assert resp.status == "cancelled" and resp.usage["output_tokens"] == 2 and resp.request is None
    assert stored_response_output(response=resp)[0]["id"] == "m1"


@override_settings(RESPONSES_RETENTION_DAYS=7)
def test_retention_and_purge(tenants) -> None:
    a, b = tenants
    assert response_retention_days(tenant_id=a.pk) == 7
    response_retention_set(tenant=b, retention_days=1)
    assert response_retention_days(tenant_id=b.pk) == 1
    ra = _store(a, "resp_a", [_msg("in_a", "x")], [])
    rb = _store(b, "resp_b", [_msg("in_b", "x")], [_msg("out_b", "y", "assistant")])
    assert ra.expires_at - ra.created_at == timedelta(days=7)
    assert rb.expires_at - rb.created_at == timedelta(days=1)
    later = timezone.now() + timedelta(days=2)
    assert stored_responses_purge_expired(now=later) == 1
    assert not StoredResponse.objects.filter(response_id="resp_b").exists()
    assert not StoredResponseItem.objects.filter(item_id__in=["in_b", "out_b"]).exists()
    assert StoredResponse.objects.filter(response_id="resp_a").exists()
    StoredResponse.objects.filter(response_id="resp_a").update(expires_at=timezone.now() - timedelta(seconds=1))
    assert stored_response_get(tenant_id=a.pk, response_id="resp_a") is None  # expired: gone before the purge
    assert purge_expired() == 1
    response_retention_set(tenant=b, retention_days=None)
    assert response_retention_days(tenant_id=b.pk) == 7
