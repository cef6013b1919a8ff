"""Issue 14, cache salt, unit level: the salt reaches the first prefix-cache block hash (and through the chain
every later one) and the image feature-cache key; the gateway's salt depends on the tenant or its cache group
and the request's ``cache_salt`` (the live behaviour is in ``test_isolation_live.py``)."""

from __future__ import annotations

from inference.engine.prefix_cache import ImageSpan, block_hashes
from inference.media.cache import mm_cache_key
from inference.protocol.engine import EngineCoreRequest, SamplingParams


def test_salt_changes_every_block_hash_and_equal_salts_agree():
    ids = list(range(48))
    plain, a, a2, b = (block_hashes(ids), block_hashes(ids, cache_salt="A"), block_hashes(ids, cache_salt="A"),
                       block_hashes(ids, cache_salt="B"))
    assert a == a2
    assert all(x != y for x, y in zip(a, b)) and all(x != y for x, y in zip(a, plain))
    assert block_hashes(ids, cache_salt="") == plain == block_hashes(ids, cache_salt=None)
    spans = [ImageSpan(4, 20, "img")]
    assert block_hashes(ids, spans, cache_salt="A") != block_hashes(ids, spans, cache_salt="B")


def test_feature_cache_key_includes_the_salt():
    settings = {"files": {"preprocessor_config.json": "x"}, "transformers": "5"}
    assert mm_cache_key(b"png", settings, "A") == mm_cache_key(b"png", settings, "A")
    assert mm_cache_key(b"png", settings, "A") != mm_cache_key(b"png", settings, "B")
    assert mm_cache_key(b"png", settings, "A") != mm_cache_key(b"png", settings)


def test_engine_request_carries_the_salt_over_the_wire():
    req = EngineCoreRequest(request_id="r-1", external_req_id="r", prompt_token_ids=[1, 2], client_id="c",
                            sampling_params=SamplingParams(), arrival_time=0.0, cache_salt="s" * 64)
    assert EngineCoreRequest.from_wire(req.to_wire()).cache_salt == "s" * 64
    old = EngineCoreRequest(request_id="r-1", external_req_id="r", prompt_token_ids=[1], client_id="c",
                            sampling_params=SamplingParams(), arrival_time=0.0)
    assert EngineCoreRequest.from_wire(old.to_wire()).cache_salt is None


def test_gateway_salt_per_tenant_group_and_request():
    from gateway.pipeline.inputs import cache_salt_for
    from tenancy.selectors import AuthContext

    def ctx(tenant_id: int, group: str = "") -> AuthContext:
        return AuthContext(key_id=1, key_prefix="sk-x", tenant_id=tenant_id, tenant_name="t", allowed_models=(),
                           scopes=("inference",), expires_at=None, cache_group=group)

    assert cache_salt_for(ctx(1)) == cache_salt_for(ctx(1)) != cache_salt_for(ctx(2))
    assert cache_salt_for(ctx(1, "g")) == cache_salt_for(ctx(2, "g")) != cache_salt_for(ctx(1))
    assert cache_salt_for(ctx(1), "r") != cache_salt_for(ctx(1))
    assert cache_salt_for(ctx(1), "r") != cache_salt_for(ctx(2), "r")  # a request salt never replaces the tenant
    assert len(cache_salt_for(ctx(1))) == 64
