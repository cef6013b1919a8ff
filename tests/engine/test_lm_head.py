"""``CpuLMHead``: every path (``mm`` for few float32 rows, ``linear`` otherwise) computes ``x @ W.T``."""

from __future__ import annotations

import pytest
import torch

from inference.engine.runner import CpuLMHead


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, CpuLMHead.MM_MAX_ROWS, CpuLMHead.MM_MAX_ROWS + 1, 40])
def test_output_projection_matches_linear(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(5000, 64, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    got = CpuLMHead(weight)(x.unsqueeze(0))[0]  # a [batch, seq, hidden] input keeps its lead dims
    want = torch.nn.functional.linear(x.float(), weight.float())
    assert got.shape == (rows, 5000) and got.is_contiguous()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=0)
    # greedy decoding reads the argmax: the paths agree on it wherever the top two logits are apart
    top2 = want.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * tol * want.abs().max().item()
    assert torch.equal(got.float().argmax(-1)[clear], want.argmax(-1)[clear])
