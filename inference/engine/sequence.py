"""``Sequence``: the engine-side state of one request, as every scheduler and runner of the engine holds it."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inference.protocol.engine import EngineCoreRequest, SamplingParams

if TYPE_CHECKING:  # field types only: this module loads neither torch nor the grammar library
    import torch

    from .prefix_cache import PrefixEntry
    from .structured import SequenceGrammar


@dataclass
class Sequence:
    """Engine-side state of one request.

    ``output_token_ids`` grows by one per step; ``num_computed`` is how many tokens are in the KV
    cache (prompt + outputs except the newest one, which is the next step's input).
    """

    request: EngineCoreRequest
    queued_ts: float
    rng: random.Random
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    scheduled_ts: float | None = None
    first_token_ts: float | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    error_code: str | None = None  # ``EngineCoreOutput.error_code`` when the engine knows the failure's kind
    bias_ids: torch.Tensor | None = None
    bias_vals: torch.Tensor | None = None
    prompt_ids_t: torch.Tensor | None = None
    # prefix caching (prefix_cache.py): the prompt's block hashes, and the cached prefix its prefill reuses
    block_hashes: list[bytes] | None = None
    prefix_entry: PrefixEntry | None = None
    num_cached_tokens: int = 0
    # ``prompt_logprobs`` entries computed at prefill (``SamplingParams.prompt_logprobs``), sent with the first token
    prompt_logprobs: list[Any] | None = None
    # ``stop_token_ids`` / ``eos_token_ids`` as sets, built once: the stop check is a lookup per step
    stop_ids: frozenset[int] = frozenset()
    eos_ids: frozenset[int] = frozenset()
    # structured outputs (``structured.py``): the request's grammar state, None when unconstrained
    grammar: SequenceGrammar | None = None
    # the batch KV cache row this sequence owns (``kv_cache.SlotKVCache``) from its prefill to its end
    slot: int | None = None
    # M-RoPE (VL runner): decode positions are ``num_computed + rope_delta``
    rope_delta: int = 0
    # the vLLM backend's ``SamplingParams`` for the request (``vllm_backend.scheduler``); None on the native engine
    backend_params: Any = None

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.request.sampling_params.stop_token_ids)
        self.eos_ids = frozenset(self.request.sampling_params.eos_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling_params
