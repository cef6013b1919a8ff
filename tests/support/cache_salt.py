"""What the cache-salt isolation tests share (issue 39): tenants with their own cache scopes, a fresh long prompt,
and the ``cached_tokens`` one chat reports. Used by ``tests/security/test_isolation_cache_salt_backends.py`` (our
engine) and ``tests/e2e/test_vllm_backend_e2e.py`` (the vLLM backend, on the replica that module already runs)."""

from __future__ import annotations

import uuid

from harness.live_platform import LivePlatform
from tests.support.live import post_json


def salt_tenants(live: LivePlatform) -> dict[str, str]:
    """API keys of new tenants ``a`` and ``b`` (each its own cache scope) and ``c`` and ``d`` (one cache group)."""
    run = uuid.uuid4().hex[:6]
    keys = {name: live.new_key(tenant=f"salt-{name}-{run}") for name in "abcd"}
    live.manage("shell", "-c", "from tenancy.models import Tenant; "
                f"Tenant.objects.filter(name__in=['salt-c-{run}', 'salt-d-{run}']).update(cache_group='g-{run}')")
    return keys


def long_prompt() -> list[dict]:
    """A fresh chat of ~380 prompt tokens: a nonce first, so its first block (and, through the chain, every block)
    is new to every cache, then text; 23 of our 16-token blocks, 2 whole ones of vLLM's 128-token CPU blocks."""
    return [{"role": "user", "content": f"Nonce {uuid.uuid4().hex}. " + "The quick brown fox jumps over the lazy "
                                        "dog while the cat sleeps by the warm fire. " * 18}]


def cached(live: LivePlatform, key: str, model: str, messages: list[dict]) -> tuple[int, int]:
    """``(cached_tokens, prompt_tokens)`` of one greedy one-token chat by ``key``."""
    status, body = post_json(live, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 1,
                                                             "temperature": 0}, key=key, timeout=120)
    assert status == 200, body
    usage = body["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0, usage["prompt_tokens"]


def check_shared_only_within_a_tenant(live: LivePlatform, tenants: dict[str, str], model: str) -> None:
    """Tenant A's repeat of its own long prompt is served from the prefix cache; tenant B's same prompt right after
    is not (before the fix, on vLLM, B got A's whole blocks back as ``cached_tokens``)."""
    p = long_prompt()
    a1, n = cached(live, tenants["a"], model, p)
    assert 256 < n < live.max_model_len
    assert a1 == 0  # a fresh prompt
    a2, _ = cached(live, tenants["a"], model, p)
    assert a2 >= 128  # caching is on: A's own repeat reuses whole blocks (at least one of vLLM's)
    b1, _ = cached(live, tenants["b"], model, p)
    assert b1 == 0  # before the fix, on vLLM: a2's figure, telling B that someone just sent this prompt


def check_shared_within_a_cache_group(live: LivePlatform, tenants: dict[str, str], model: str) -> None:
    """Two tenants of one ``cache_group`` share cached blocks; a tenant outside it does not."""
    q = long_prompt()
    assert cached(live, tenants["c"], model, q)[0] == 0
    assert cached(live, tenants["d"], model, q)[0] >= 128  # the operator's group is one cache scope
    assert cached(live, tenants["a"], model, q)[0] == 0  # but not with a tenant outside it
