"""The CPU output projection (``x @ W.T`` over the vocabulary), by whichever of torch's paths is faster on this CPU
for the step's number of rows, chosen by timing the calls it serves (D-291, D-294)."""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("inference.engine")
_clock = time.perf_counter  # seconds; the tests give their own


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` ``[out, in]`` reordered into oneDNN's blocked layout for ``torch.ops.mkldnn._linear_pointwise`` (the
    packed-weight matmul PyTorch's inductor uses on CPU; vLLM's CPU backend packs its linear weights for oneDNN
    likewise), or ``None`` where this torch build or CPU has no such path or it does not reproduce
    ``nn.functional.linear`` on a probe (checked here, once). The packed tensor is a second copy of the weight."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        probe = torch.linspace(-1, 1, 2 * weight.shape[1], dtype=weight.dtype).reshape(2, -1)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        want = torch.nn.functional.linear(probe, weight.detach())
    except (RuntimeError, AttributeError, NotImplementedError) as exc:  # no kernel for this dtype/CPU, no op
        log.info("no oneDNN packed weight for %s %s: %s", tuple(weight.shape), weight.dtype, exc)
        return None
    tol = 1e-3 if weight.dtype == torch.float32 else 5e-2
    scale = max(1.0, want.abs().max().item())
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), atol=tol * scale, rtol=0):
        log.warning("oneDNN packed weight for %s %s disagrees with linear: not used", tuple(weight.shape), weight.dtype)
        return None
    return packed


class CpuLMHead(torch.nn.Module):
    """The output projection ``x @ W.T`` on the CPU (``W``: ``[vocab, hidden]``, e.g. 151,680 × 128), by the fastest
    of ``nn.functional.linear(x, W)``, ``torch.mm(W, x.T).T`` and oneDNN's matmul over a packed copy of ``W``
    (``pack_for_onednn``; path ``packed``, where the build has it) for the number of rows in the call.

    Which one is faster depends on the CPU, the BLAS/oneDNN build, the dtype and the rows, and by several times:
    - Intel with AVX512 (D-271, torch 2.13): float32 ``mm`` 9-10 ms against ``linear`` 18 ms at 1-15 rows,
      ``linear`` the faster from 16 rows; bfloat16 ``linear`` (oneDNN's AVX512-BF16/AMX kernels) 3-5× faster than
      ``mm`` at every row count.
    - AMD EPYC (Zen 1, AVX2 only, same build): float32 16 rows ``mm`` 19.8 ms against ``linear`` 34.3 ms.
    - AMD EPYC (Zen 4, AVX512-BF16, same build; D-294): float32 ``packed`` 1.9 / 4.4 / 13.6 ms at 1 / 16 / 64 rows
      against ``linear`` 9.7 / 14.8 / 40.2 and ``mm`` 9.7 / 12.6 / 58.4; bfloat16 ``packed`` 0.5 / 1.8 / 7.0 against
      ``linear`` 2.7 / 5.4 / 11.1.
    A fixed threshold tuned on one of them is wrong on the other, so the choice is measured where it runs: rows are
    grouped in power-of-two buckets (1, 2, 3-4, 5-8, ...), and the first ``SAMPLES`` calls of each bucket on each
    path are timed while serving (real work, never extra calls; the paths alternate call by call), after which the
    bucket keeps the path with the lower fastest time. The fastest, not the median: on a CPU shared with the api
    and render processes a call only ever gets slower than its own cost (a descheduled thread holds up the op's
    barrier), and a median of three taken while 16 requests arrived chose the slower path in one of two runs
    (D-291). Calls of more than ``MAX_TIMED_ROWS`` rows (prompt logprobs over a long prompt) always take
    ``linear``: ``mm`` would need a transposed copy of a large ``[rows, vocab]`` result.

    A single row on the ``mm`` path is padded to two (torch's 1-row GEMV path is the slow one). Same weight object,
    so tied embeddings stay tied; every path gives the same logits up to float rounding. The packed copy costs the
    memory of the weight once more (78 MB for a 151,680 × 128 float32 head), kept for the engine's life.
    """

    SAMPLES = 5  # timed calls per path and bucket before the bucket's path is fixed
    MAX_TIMED_ROWS = 512

    def __init__(self, weight: torch.Tensor, *, pack: bool = True):
        super().__init__()
        self.weight = weight
        self._packed = pack_for_onednn(weight) if pack else None
        # the candidate paths, in the order they are tried
        self.paths: tuple[str, ...] = ("packed", "mm", "linear") if self._packed is not None else ("mm", "linear")
        self._times: dict[int, dict[str, list[float]]] = {}  # bucket → path → seconds per call
        self._chosen: dict[int, str] = {}  # bucket → one of ``paths``, once measured

    @staticmethod
    def bucket(rows: int) -> int:
        """The power of two at or above ``rows`` (1, 2, 4, 8, ...): rows that share a bucket share a path."""
        return 1 << max(0, rows - 1).bit_length()

    def path_for(self, rows: int) -> str | None:
        """The path fixed for ``rows`` rows (one of ``paths``), or None while it is still being measured."""
        if rows > self.MAX_TIMED_ROWS:
            return "linear"
        return self._chosen.get(self.bucket(rows))

    def project(self, flat: torch.Tensor, path: str) -> torch.Tensor:
        """``flat`` ``[rows, hidden]`` → contiguous logits ``[rows, vocab]`` by ``path`` (one of ``paths``)."""
        if path == "linear":
            return torch.nn.functional.linear(flat, self.weight)
        if path == "packed":
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), self._packed, None, "none", [],
                                                                   "")
            return out
        rows = flat.shape[0]
        if rows == 1:
            flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
        return torch.mm(self.weight, flat.t()).t()[:rows].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., hidden]`` → logits ``[..., vocab]`` (contiguous)."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        path = self.path_for(rows)
        if path is not None:
            out = self.project(flat, path)
        else:
            out = self._measured(flat, rows)
        return out.reshape(*lead, out.shape[-1])

    def _measured(self, flat: torch.Tensor, rows: int) -> torch.Tensor:
        b = self.bucket(rows)
        times = self._times.setdefault(b, {p: [] for p in self.paths})
        path = min(self.paths, key=lambda p: len(times[p]))  # the paths take turns, call by call
        t0 = _clock()
        out = self.project(flat, path)
        times[path].append(_clock() - t0)
        if min(len(v) for v in times.values()) >= self.SAMPLES:
            best = {p: min(v) for p, v in times.items()}
            self._chosen[b] = min(best, key=lambda p: best[p])
            del self._times[b]
            log.info("output projection: %s for %d-%d rows (%s; fastest of %d calls, ms: %s)", self._chosen[b],
                     b // 2 + 1, b, self.weight.dtype, self.SAMPLES,
                     ", ".join(f"{p} {best[p] * 1e3:.2f}" for p in self.paths))
        return out
