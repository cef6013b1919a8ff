"""The positions an engine serves per sequence (``runner.effective_max_model_len``): the registry's ``max_model_len``,
beyond ``max_position_embeddings`` only for rotary positions, so that the gateway's length checks (made against the
registry's value) and the engine agree."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import GPT2Config, PretrainedConfig, Qwen3Config

from inference.engine.runner import ModelRunner, effective_max_model_len
from tests.engine.conftest import MODEL_DIR


def test_the_configs_length_when_none_is_registered():
    assert effective_max_model_len(None, Qwen3Config(max_position_embeddings=4096)) == 4096
    assert effective_max_model_len(None, PretrainedConfig()) == 4096  # no table size known
    assert effective_max_model_len(2048, Qwen3Config(max_position_embeddings=4096)) == 2048


def test_rotary_positions_serve_a_longer_registered_length_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="inference.engine"):
        assert effective_max_model_len(32768, Qwen3Config(max_position_embeddings=4096)) == 32768
    assert "exceeds the model's max_position_embeddings 4096" in caplog.text
    assert effective_max_model_len(10_000, PretrainedConfig()) == 10_000


def test_learned_positions_refuse_a_length_past_their_table():
    cfg = GPT2Config(n_positions=1024)
    assert effective_max_model_len(1024, cfg) == 1024
    with pytest.raises(ValueError, match="max_model_len 2048 exceeds .* 1024, and its positions are not rotary"):
        effective_max_model_len(2048, cfg)


def test_a_length_the_model_cannot_serve_fails_before_its_weights_load(tmp_path):
    """The directory has a config and no weights: the refusal comes first (a replica's supervisor would otherwise
    load a large model's weights once per restart before giving up)."""
    GPT2Config(n_positions=1024, n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="positions are not rotary"):
        ModelRunner(str(tmp_path), max_model_len=2048)


def test_dynamic_rope_refuses_a_length_past_its_table():
    """transformers' dynamic RoPE rescales the frequencies of a whole batched forward once any position passes
    ``max_position_embeddings``: one long sequence would change its batch companions' outputs."""
    flat = Qwen3Config(max_position_embeddings=256, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                     "rope_theta": 10000.0})
    assert effective_max_model_len(256, flat) == 256
    with pytest.raises(ValueError, match="RoPE is dynamic"):
        effective_max_model_len(1024, flat)
    per_layer = PretrainedConfig(max_position_embeddings=256, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="RoPE is dynamic"):
        effective_max_model_len(1024, per_layer)
    static = Qwen3Config(max_position_embeddings=256, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                       "rope_theta": 10000.0,
                                                                       "original_max_position_embeddings": 256})
    assert effective_max_model_len(1024, static) == 1024


def test_the_demo_model_serves_the_registered_length():
    """Before, the runner capped it to the config's 4,096 silently: a 4,545-token prompt that the gateway had admitted
    under a registered 32,768 failed mid-stream (found by ``bench/multiturn.py --ttft``)."""
    runner = ModelRunner(str(MODEL_DIR), max_model_len=8192, prefix_cache_mb=0)
    assert runner.max_model_len == 8192 and runner.config.max_position_embeddings == 4096
    with torch.no_grad():  # positions past the trained 4,096 compute (rotary): 5,000 tokens, finite logits
        logits = runner.model(input_ids=torch.arange(1000, 6000).unsqueeze(0)).logits
    assert logits.shape[1] == 5000 and bool(torch.isfinite(logits[0, -1]).all())
