"""PoolingRunner (the engine's pooling mode) against all-MiniLM-L6-v2 run directly with transformers."""

from __future__ import annotations

import pytest
import torch

from inference.engine.pooling import PoolingRunner, pool, pooling_recipe
from harness.minilm_reference import DirectMiniLM
from harness.assets import minilm_dir

TEXTS = ["a cat", "a kitten", "a carburetor", "The quick brown fox jumps over the lazy dog, twice."]


@pytest.fixture(scope="module")
def direct():
    return DirectMiniLM(minilm_dir())


@pytest.fixture(scope="module")
def runner():
    return PoolingRunner(minilm_dir())


def test_recipe_from_sentence_transformers_files():
    r = pooling_recipe(minilm_dir())
    assert r == {"mode": "mean", "normalize": True, "max_seq_length": 256}


def test_runner_matches_direct(runner, direct):
    ref = direct.embed(TEXTS)
    ids = [direct.tok(t)["input_ids"] for t in TEXTS]
    got = runner.embed(ids)
    assert got.shape == (4, 384)
    assert float((got - ref).abs().max()) <= 1e-5
    assert torch.allclose(got.norm(dim=-1), torch.ones(4), atol=1e-5)
    assert runner.max_model_len == 256


def test_batch_independent_of_companions(runner, direct):
    ids = [direct.tok(t)["input_ids"] for t in TEXTS]
    alone = runner.embed(ids[:1])
    batched = runner.embed(ids)
    assert float((alone[0] - batched[0]).abs().max()) <= 1e-5


def test_pool_modes():
    h = torch.tensor([[[1.0, 0.0], [3.0, 2.0], [100.0, 100.0]]])
    m = torch.tensor([[1, 1, 0]])
    assert pool(h, m, "mean", False).tolist() == [[2.0, 1.0]]
    assert pool(h, m, "cls", False).tolist() == [[1.0, 0.0]]
    assert pool(h, m, "max", False).tolist() == [[3.0, 2.0]]
    assert pool(h, m, "lasttoken", False).tolist() == [[3.0, 2.0]]
    n = pool(h, m, "mean", True)
    assert abs(float(n.norm()) - 1.0) < 1e-6
