"""Issue 39, the tenant's cache salt on every engine backend, end to end on the shared live platform
(``shared_live``: the demo model ``tiny-qwen3`` on the native engine) and a second served model of the same
directory registered with ``--backend vllm`` (one vLLM replica, as ``tests/e2e/test_vllm_backend_e2e.py`` starts
it; skipped when vLLM's environment ``.peer/vllm`` is missing: ``scripts/setup.sh --vllm``).

For each backend: tenant A's repeat of its own long prompt is served from the prefix cache (``cached_tokens`` > 0,
so caching is on), tenant B sending the same prompt right after gets ``cached_tokens`` 0, and two tenants in one
``cache_group`` share. Before the fix the vLLM backend dropped ``EngineCoreRequest.cache_salt`` (vLLM hashed
every tenant's blocks unsalted) and B got all of A's whole KV blocks back as ``cached_tokens`` (vLLM's CPU blocks
are 128 tokens, so the prompt spans several of them; our engine's blocks are 16 tokens). Without vLLM, the
salt's place in vLLM's prompt (``vllm_backend.params.tokens_prompt``) is checked alone.
"""

from __future__ import annotations

import uuid

import pytest

from inference.engine.vllm_backend.params import tokens_prompt
from inference.protocol.engine import EngineCoreRequest, SamplingParams
from harness.assets import DEMO_MODEL, MODEL_DIR, VLLM_PYTHON
from tests.support.live import ensure_model, post_json, stop_child

VLLM_MODEL = "tiny-qwen3-vllm-salt"  # its own name: the e2e module registers, stops and disables tiny-qwen3-vllm
VLLM_ENGINE = f"engine-{VLLM_MODEL}"


@pytest.fixture(scope="module")
def live(shared_live):
    """The shared live platform (tests/conftest.py); this module leaves it as it found it."""
    return shared_live


@pytest.fixture(scope="module")
def tenants(live) -> dict[str, str]:
    """API keys of tenants ``a`` and ``b`` (each its own cache scope) and ``c`` and ``d`` (one cache group)."""
    run = uuid.uuid4().hex[:6]
    keys = {name: live.new_key(tenant=f"salt-{name}-{run}") for name in "abcd"}
    live.manage("shell", "-c", "from tenancy.models import Tenant; "
                f"Tenant.objects.filter(name__in=['salt-c-{run}', 'salt-d-{run}']).update(cache_group='g-{run}')")
    return keys


@pytest.fixture(scope="module")
def vllm_model(live):
    """``VLLM_MODEL`` registered with ``--backend vllm`` and served by one vLLM replica; stopped and disabled after."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (scripts/setup.sh --vllm)")
    ensure_model(live, VLLM_MODEL, MODEL_DIR, "--max-model-len", str(live.max_model_len), "--backend", "vllm")
    try:
        live.start_engine(VLLM_ENGINE, model=VLLM_MODEL, backend="vllm")
        yield VLLM_MODEL
    finally:
        stop_child(live, VLLM_ENGINE, grace_s=30)  # SIGTERM to its group: the link and vLLM's engine-core process
        live.manage("register_model", VLLM_MODEL, str(MODEL_DIR), "--enabled", "false")
        live.extra.get("registered", set()).discard(VLLM_MODEL)


@pytest.fixture(params=["native", "vllm"])
def model(request) -> str:
    """The served model of the backend under test (the vLLM one started on first use)."""
    return DEMO_MODEL if request.param == "native" else request.getfixturevalue("vllm_model")


def long_prompt() -> list[dict]:
    """A fresh chat of ~380 prompt tokens: a nonce first, so its first block (and, through the chain, every block)
    is new to every cache, then text; 23 of our 16-token blocks, 2 whole ones of vLLM's 128-token CPU blocks."""
    return [{"role": "user", "content": f"Nonce {uuid.uuid4().hex}. " + "The quick brown fox jumps over the lazy "
                                        "dog while the cat sleeps by the warm fire. " * 18}]


def cached(live, key: str, model: str, messages: list[dict]) -> tuple[int, int]:
    """``(cached_tokens, prompt_tokens)`` of one greedy one-token chat by ``key``."""
    status, body = post_json(live, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 1,
                                                             "temperature": 0}, key=key, timeout=120)
    assert status == 200, body
    usage = body["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0, usage["prompt_tokens"]


def test_prefix_cache_is_shared_only_within_a_tenant(live, tenants, model):
    p = long_prompt()
    a1, n = cached(live, tenants["a"], model, p)
    assert 256 < n < live.max_model_len
    assert a1 == 0  # a fresh prompt
    a2, _ = cached(live, tenants["a"], model, p)
    assert a2 >= 128  # caching is on: A's own repeat reuses whole blocks (at least one of vLLM's)
    b1, _ = cached(live, tenants["b"], model, p)
    assert b1 == 0  # before the fix, on vLLM: a2's figure, telling B that someone just sent this prompt


def test_prefix_cache_is_shared_within_a_cache_group(live, tenants, model):
    q = long_prompt()
    assert cached(live, tenants["c"], model, q)[0] == 0
    assert cached(live, tenants["d"], model, q)[0] >= 128  # the operator's group is one cache scope
    assert cached(live, tenants["a"], model, q)[0] == 0  # but not with a tenant outside it


def test_vllm_prompt_carries_the_salt():
    """The request's salt becomes ``TokensPrompt.cache_salt``; none (or empty) leaves it out, as vLLM then hashes
    unsalted, like ours."""
    def req(salt: str | None) -> EngineCoreRequest:
        return EngineCoreRequest(request_id="r-1", external_req_id="r", prompt_token_ids=[5, 6, 7], client_id="c",
                                 sampling_params=SamplingParams(), arrival_time=0.0, cache_salt=salt)

    assert tokens_prompt(req("s" * 64)) == {"prompt_token_ids": [5, 6, 7], "cache_salt": "s" * 64}
    assert tokens_prompt(req(None)) == tokens_prompt(req("")) == {"prompt_token_ids": [5, 6, 7]}
