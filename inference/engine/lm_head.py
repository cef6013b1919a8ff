"""The CPU output projection (``x @ W.T`` over the vocabulary), by whichever of torch's two paths is faster on this
CPU for the step's number of rows, chosen by timing the calls it serves (D-291)."""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("inference.engine")
_clock = time.perf_counter  # seconds; the tests give their own


class CpuLMHead(torch.nn.Module):
    """The output projection ``x @ W.T`` on the CPU (``W``: ``[vocab, hidden]``, e.g. 151,680 × 128), by the faster
    of ``nn.functional.linear(x, W)`` and ``torch.mm(W, x.T).T`` for the number of rows in the call.

    Which one is faster depends on the CPU, the BLAS/oneDNN build, the dtype and the rows, and by several times:
    - Intel with AVX512 (D-271, torch 2.13): float32 ``mm`` 9-10 ms against ``linear`` 18 ms at 1-15 rows,
      ``linear`` the faster from 16 rows; bfloat16 ``linear`` (oneDNN's AVX512-BF16/AMX kernels) 3-5× faster than
      ``mm`` at every row count.
    - AMD EPYC (Zen 1, AVX2 only, same build): float32 16 rows ``mm`` 19.8 ms against ``linear`` 34.3 ms.
    A fixed threshold tuned on one of them is wrong on the other, so the choice is measured where it runs: rows are
    grouped in power-of-two buckets (1, 2, 3-4, 5-8, ...), and the first ``SAMPLES`` calls of each bucket on each
    path are timed while serving (real work, never extra calls; the paths alternate call by call), after which the
    bucket keeps the path with the lower fastest time. The fastest, not the median: on a CPU shared with the api
    and render processes a call only ever gets slower than its own cost (a descheduled thread holds up the op's
    barrier), and a median of three taken while 16 requests arrived chose the slower path in one of two runs
    (D-291). Calls of more than ``MAX_TIMED_ROWS`` rows (prompt logprobs over a long prompt) always take
    ``linear``: ``mm`` would need a transposed copy of a large ``[rows, vocab]`` result.

    A single row on the ``mm`` path is padded to two (torch's 1-row GEMV path is the slow one). Same weight object,
    so tied embeddings stay tied; both paths give the same logits up to float rounding.
    """

    SAMPLES = 5  # timed calls per path and bucket before the bucket's path is fixed
    MAX_TIMED_ROWS = 512

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight
        self._times: dict[int, dict[str, list[float]]] = {}  # bucket → path → seconds per call
        self._chosen: dict[int, str] = {}  # bucket → "mm" | "linear", once measured

    @staticmethod
    def bucket(rows: int) -> int:
        """The power of two at or above ``rows`` (1, 2, 4, 8, ...): rows that share a bucket share a path."""
        return 1 << max(0, rows - 1).bit_length()

    def path_for(self, rows: int) -> str | None:
        """The path fixed for ``rows`` rows (``"mm"`` or ``"linear"``), or None while it is still being measured."""
        if rows > self.MAX_TIMED_ROWS:
            return "linear"
        return self._chosen.get(self.bucket(rows))

    def project(self, flat: torch.Tensor, path: str) -> torch.Tensor:
        """``flat`` ``[rows, hidden]`` → contiguous logits ``[rows, vocab]`` by ``path`` (``"mm"`` or ``"linear"``)."""
        if path == "linear":
            return torch.nn.functional.linear(flat, self.weight)
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
        times = self._times.setdefault(b, {"mm": [], "linear": []})
        path = "mm" if len(times["mm"]) <= len(times["linear"]) else "linear"
        t0 = _clock()
        out = self.project(flat, path)
        times[path].append(_clock() - t0)
        if min(len(v) for v in times.values()) >= self.SAMPLES:
            best = {p: min(v) for p, v in times.items()}
            self._chosen[b] = min(best, key=lambda p: best[p])
            del self._times[b]
            log.info("output projection: %s for %d-%d rows (%s; fastest of %d calls, ms: mm %.2f, linear %.2f)",
                     self._chosen[b], b // 2 + 1, b, self.weight.dtype, self.SAMPLES, best["mm"] * 1e3,
                     best["linear"] * 1e3)
        return out
