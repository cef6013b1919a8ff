"""Order statistics of the benchmarks' samples."""

from __future__ import annotations


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values``: the sample at rank ``round(q × (n - 1))`` of the sorted values (no
    interpolation); NaN when there are none."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(q * (len(values) - 1)))))]
