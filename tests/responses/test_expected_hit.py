"""A stored conversation's follow-up prefers the replica that served its parent (inference/api/router.py
``with_expected_hit``, ``inference.api.engine_client.EXPECTED_HIT``): that replica counts as holding the parent's
prompt, and the choice still weighs the saving against its load."""

from __future__ import annotations

from inference.api.engine_client import EXPECTED_HIT, ExpectedHit
from inference.api.router import ReplicaView, choose_replica, with_expected_hit


def test_the_parents_replica_wins_an_otherwise_even_choice() -> None:
    views = [ReplicaView("a"), ReplicaView("b")]
    hinted = with_expected_hit(views, "b", 256)
    assert [v.hit_tokens for v in hinted] == [0, 256]
    assert choose_replica(300, hinted).engine_id == "b"


def test_a_published_hit_larger_than_the_hint_stays() -> None:
    assert with_expected_hit([ReplicaView("a", hit_tokens=512)], "a", 256)[0].hit_tokens == 512


def test_load_still_counts() -> None:
    busy = ReplicaView("b", queued_tokens=5000, num_requests=20)
    assert choose_replica(300, with_expected_hit([ReplicaView("a"), busy], "b", 256)).engine_id == "a"


def test_the_hint_is_unset_outside_its_context() -> None:
    assert EXPECTED_HIT.get() is None
    token = EXPECTED_HIT.set(ExpectedHit("b", 64))
    try:
        assert EXPECTED_HIT.get() == ExpectedHit("b", 64)
    finally:
        EXPECTED_HIT.reset(token)
    assert EXPECTED_HIT.get() is None
