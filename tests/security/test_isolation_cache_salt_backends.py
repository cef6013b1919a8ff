"""Issue 39, the tenant's cache salt on every engine backend, end to end on the shared live platform
(``shared_live``: the demo model ``tiny-qwen3`` on our engine). The same checks on the vLLM backend run in
``tests/e2e/test_vllm_backend_e2e.py`` on the vLLM replica that module already runs (a replica of its own here cost
~33 s of start-up); without vLLM, the salt's place in vLLM's prompt (``vllm_backend.params.tokens_prompt``) is
checked alone below.

Tenant A's repeat of its own long prompt is served from the prefix cache (``cached_tokens`` > 0, so caching is on),
tenant B sending the same prompt right after gets ``cached_tokens`` 0, and two tenants in one ``cache_group`` share.
Before the fix the vLLM backend dropped ``EngineCoreRequest.cache_salt`` (vLLM hashed every tenant's blocks
unsalted) and B got all of A's whole KV blocks back as ``cached_tokens`` (vLLM's CPU blocks are 128 tokens, so the
prompt spans several of them; our engine's blocks are 16 tokens).
"""

from __future__ import annotations

import pytest

from harness.assets import DEMO_MODEL
from inference.engine.vllm_backend.params import tokens_prompt
from inference.protocol.engine import EngineCoreRequest, SamplingParams
from tests.support.cache_salt import check_shared_only_within_a_tenant, check_shared_within_a_cache_group, salt_tenants


@pytest.fixture(scope="module")
def live(shared_live):
    """The shared live platform (tests/conftest.py); this module leaves it as it found it."""
    return shared_live


@pytest.fixture(scope="module")
def tenants(live) -> dict[str, str]:
    """API keys of tenants ``a`` and ``b`` (each its own cache scope) and ``c`` and ``d`` (one cache group)."""
    return salt_tenants(live)


def test_prefix_cache_is_shared_only_within_a_tenant(live, tenants):
    check_shared_only_within_a_tenant(live, tenants, DEMO_MODEL)


def test_prefix_cache_is_shared_within_a_cache_group(live, tenants):
    check_shared_within_a_cache_group(live, tenants, DEMO_MODEL)


def test_vllm_prompt_carries_the_salt():
    """The request's salt becomes ``TokensPrompt.cache_salt``; none (or empty) leaves it out, as vLLM then hashes
    unsalted, like ours."""
    def req(salt: str | None) -> EngineCoreRequest:
        return EngineCoreRequest(request_id="r-1", external_req_id="r", prompt_token_ids=[5, 6, 7], client_id="c",
                                 sampling_params=SamplingParams(), arrival_time=0.0, cache_salt=salt)

    assert tokens_prompt(req("s" * 64)) == {"prompt_token_ids": [5, 6, 7], "cache_salt": "s" * 64}
    assert tokens_prompt(req(None)) == tokens_prompt(req("")) == {"prompt_token_ids": [5, 6, 7]}
