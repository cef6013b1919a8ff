"""``CpuLMHead``: every path computes ``x @ W.T``, and each row bucket settles on the path its timed calls found fastest."""

from __future__ import annotations

import pytest
import torch

from inference.engine import lm_head
from inference.engine.lm_head import CpuLMHead


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 15, 16, 40])
@pytest.mark.parametrize("path", ["packed", "mm", "linear"])
def test_output_projection_matches_linear(dtype, rows, path):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(5000, 64, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    head = CpuLMHead(weight)
    if path == "packed" and dtype == torch.bfloat16 and path not in head.paths:
        # oneDNN's bfloat16 reorder needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: on a CPU without them the head
        # rightly has no packed path, and the op itself must say so
        with pytest.raises(RuntimeError) as refused:
            torch.ops.mkldnn._reorder_linear_weight(weight)
        pytest.skip(f"no oneDNN bfloat16 packed matmul on this CPU: {str(refused.value)[:120]}")
    assert path in head.paths  # float32's packed path everywhere: torch's CPU build has oneDNN
    got = head.project(x, path)
    want = torch.nn.functional.linear(x.float(), weight.float())
    assert got.shape == (rows, 5000) and got.is_contiguous()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=0)
    # greedy decoding reads the argmax: the paths agree on it wherever the top two logits are apart
    top2 = want.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * tol * want.abs().max().item()
    assert torch.equal(got.float().argmax(-1)[clear], want.argmax(-1)[clear])


def test_packed_path_reads_a_non_contiguous_input_and_can_be_left_out():
    weight = torch.randn(3000, 32)
    x = torch.randn(32, 8).t()  # [8, 32], not contiguous
    torch.testing.assert_close(CpuLMHead(weight).project(x, "packed"), torch.nn.functional.linear(x, weight),
                               atol=1e-4, rtol=1e-4)
    assert CpuLMHead(weight, pack=False).paths == ("mm", "linear")


def test_pack_for_onednn_refuses_what_it_cannot_reproduce(monkeypatch):
    """A build whose packed matmul is missing or wrong for a dtype gives no packed path (checked on a probe)."""
    weight = torch.randn(300, 16)
    assert lm_head.pack_for_onednn(weight) is not None

    def broken(x, w, b, attr, scalars, algorithm):
        return torch.zeros(x.shape[0], w.shape[0])
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", broken)
    assert lm_head.pack_for_onednn(weight) is None
    assert CpuLMHead(weight).paths == ("mm", "linear")

    def missing(x, w, b, attr, scalars, algorithm):
        raise RuntimeError("no kernel")
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", missing)
    assert lm_head.pack_for_onednn(weight) is None


def test_buckets_are_powers_of_two():
    assert [CpuLMHead.bucket(r) for r in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]


class _Clock:
    """``lm_head._clock``: each projection by ``mm`` takes ``mm_s``, by ``linear`` ``linear_s``, by ``packed``
    ``packed_s`` (the cost is charged when the call returns)."""

    def __init__(self, head: CpuLMHead, mm_s: float, linear_s: float, packed_s: float = 1.0):
        self.now = 0.0
        self.cost = {"mm": mm_s, "linear": linear_s, "packed": packed_s}
        real = head.project

        def project(flat, path):
            self.now += self.cost[path]
            return real(flat, path)
        head.project = project  # type: ignore[method-assign]

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize("mm_s, linear_s, packed_s, want", [(0.010, 0.030, 0.020, "mm"), (0.030, 0.010, 0.020, "linear"),
                                                             (0.030, 0.010, 0.004, "packed")])
def test_each_bucket_keeps_the_path_its_calls_measured_faster(monkeypatch, mm_s, linear_s, packed_s, want):
    weight = torch.randn(3000, 32)
    head = CpuLMHead(weight)
    clock = _Clock(head, mm_s, linear_s, packed_s)
    monkeypatch.setattr(lm_head, "_clock", clock.perf_counter)
    x = torch.randn(1, 6, 32)  # [batch, seq, hidden]: 6 rows, bucket 8
    want_out = torch.nn.functional.linear(x, weight)
    for _ in range(len(head.paths) * CpuLMHead.SAMPLES - 1):
        assert head.path_for(6) is None  # still measuring: the calls alternate paths, each one real work
        torch.testing.assert_close(head(x), want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(head(x), want_out, atol=1e-4, rtol=1e-4)
    assert head.path_for(5) == head.path_for(8) == want  # the whole bucket 5-8
    assert head.path_for(4) is None and head.path_for(9) is None  # other buckets measure on their own
    assert head.path_for(CpuLMHead.MAX_TIMED_ROWS + 1) == "linear"
    settled = clock.now
    head(x)
    assert clock.now - settled == pytest.approx(clock.cost[want])  # and it is the one used from now on


def test_calls_slowed_by_other_work_do_not_decide(monkeypatch):
    """The first call on a path pays one-off costs (a oneDNN primitive built, pages touched) and calls on a shared
    CPU are slowed by other processes: each path's fastest call decides, not a mean or the first."""
    weight = torch.randn(3000, 32)
    head = CpuLMHead(weight)
    clock = _Clock(head, 0.010, 0.020, 0.030)
    monkeypatch.setattr(lm_head, "_clock", clock.perf_counter)
    x = torch.randn(2, 32)
    calls = len(head.paths) * CpuLMHead.SAMPLES
    for i in range(calls):
        clock.cost["mm"] = 0.010 if i == calls - 2 else 1.0  # one mm call was not held up
        head(x)
    assert head.path_for(2) == "mm"
