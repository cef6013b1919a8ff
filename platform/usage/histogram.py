"""Fixed log-spaced latency histograms: mergeable by addition, percentiles by interpolation.

Bucket ``i`` (``0 <= i < NUM_BUCKETS``) holds values in ``[EDGES[i], EDGES[i+1])`` ms, with
``EDGES[0] = 0``, ``EDGES[1] = 1`` ms and a ratio of ``RATIO`` (1.2) between further edges, up to
~10 minutes; the last bucket is open. Relative error of an interpolated percentile: under 10 %.
Counts are stored as plain lists of ints (``UsageRollup.ttft_hist`` / ``e2e_hist``).
"""

from __future__ import annotations

import bisect
import math
from typing import Iterable

RATIO = 1.2
NUM_BUCKETS = 2 + math.ceil(math.log(600_000) / math.log(RATIO))  # 0..1 ms, then up to 600 s
EDGES: list[float] = [0.0] + [RATIO ** i for i in range(NUM_BUCKETS - 1)]


def bucket_of(value_ms: float) -> int:
    """Index of the bucket holding ``value_ms`` (negative values count as 0, huge ones in the last bucket)."""
    if not value_ms > 0:
        return 0
    return min(NUM_BUCKETS - 1, bisect.bisect_right(EDGES, value_ms) - 1)


def hist_new() -> list[int]:
    """An empty histogram (``NUM_BUCKETS`` zeros)."""
    return [0] * NUM_BUCKETS


def hist_add(hist: list[int], other: Iterable[int]) -> list[int]:
    """``hist += other`` elementwise (in place; a shorter/empty ``hist`` is extended); returns ``hist``."""
    other = list(other or ())
    if len(hist) < len(other):
        hist.extend([0] * (len(other) - len(hist)))
    for i, count in enumerate(other):
        hist[i] += count
    return hist


def hist_quantile(hist: list[int], q: float) -> float | None:
    """The ``q``-quantile (0..1) in ms, linearly interpolated inside its bucket; None for an empty histogram."""
    total = sum(hist)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(hist):
        if count and seen + count >= rank:
            lo = EDGES[i]
            hi = EDGES[i + 1] if i + 1 < len(EDGES) else EDGES[i] * RATIO
            return lo + (hi - lo) * max(0.0, (rank - seen)) / count
        seen += count
    return EDGES[-1]
