"""``greedy_argmax``: the same ids as ``torch.argmax(logits, -1)``, ties to the lowest id, whatever the vocabulary."""

from __future__ import annotations

import pytest
import torch

from inference.engine.sampler import greedy_argmax


@pytest.mark.parametrize("vocab", [151_680, 4096, 32 * 37, 1000, 7])
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_ids_as_argmax(vocab, rows, dtype):
    gen = torch.Generator().manual_seed(vocab + rows)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    assert torch.equal(greedy_argmax(logits), torch.argmax(logits, dim=-1))


def test_ties_masked_rows_and_infinities():
    logits = torch.randn(6, 4096)
    logits[0, [5, 700, 4000]] = 50.0  # a tie across blocks: the lowest id
    logits[1, [130, 129]] = 50.0  # a tie within a block
    logits[2] = float("-inf")  # a fully masked row: id 0, as argmax
    logits[3, :] = float("-inf")
    logits[3, 4095] = 1.0  # the last id, the only one allowed
    logits[4, 77] = 1e30  # sample()'s stand-in for +inf
    logits[5, :128] = float("-inf")  # a masked first block
    got = greedy_argmax(logits)
    assert got.tolist() == torch.argmax(logits, dim=-1).tolist() == [5, 129, 0, 4095, 77, got[5].item()]
    assert got[5].item() >= 128


def test_non_contiguous_logits_take_argmax():
    logits = torch.randn(4096, 8).t()  # [8, 4096], a view
    assert torch.equal(greedy_argmax(logits), torch.argmax(logits, dim=-1))
