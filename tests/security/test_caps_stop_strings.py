"""Issue 14, stop strings: the partial-match check no longer re-scans the held-back window per candidate
start, so the work per pushed text does not grow with the stop strings' length; outputs are unchanged.

Work is counted as Python line events inside ``inference.api.output_processor`` (``sys.settrace``), not timed:
the same output pushed token by token through the real qwen3 detokenizer, with two stop strings of 16 and of
1,024 characters (the cap) that never match."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

import inference.api.output_processor as op
from inference.api.output_processor import IncrementalDetokenizer, StopChecker
from inference.renderer.tokenizer_cache import get_tokenizer

REPO = Path(__file__).resolve().parents[2]


def line_events(fn) -> int:
    """Line events executed in ``inference/api/output_processor.py`` while ``fn()`` runs."""
    count = 0

    def tracer(frame, event, _arg):
        nonlocal count
        if frame.f_code.co_filename != op.__file__:
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def stream(tok, output: list[int], stop: list[str]) -> str:
    detok, stops = IncrementalDetokenizer(tok, [1, 2, 3]), StopChecker(stop)
    out = [stops.push(detok.push([t]))[0] for t in output]
    out.append(stops.push(detok.flush())[0])
    out.append(stops.flush()[0])
    return "".join(out)


def test_stop_check_work_does_not_grow_with_stop_length():
    tok = get_tokenizer(str(REPO / ".cache" / "tokenizers" / "qwen3"))
    rnd = random.Random(0)
    text = " ".join(rnd.choice(["alpha", "beta", "gamma", "story", "the", "of"]) for _ in range(600))
    output = tok.encode(text, add_special_tokens=False)[:300]
    # never match, but share prefixes with the output (each starts with a letter the output has)
    stops = {n: ["a" + "".join(rnd.choice("bcdefghij") for _ in range(n - 1)) for _ in range(2)] for n in (16, 1024)}
    results = {n: [] for n in stops}
    work = {n: line_events(lambda n=n: results[n].append(stream(tok, output, stops[n]))) for n in stops}
    assert results[16] == results[1024]
    assert work[1024] <= 1.5 * work[16], work


def reference(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """Whole-text semantics: cut at the earliest occurrence; at one start the shorter stop string wins."""
    hits = [(text.find(s), len(s), s) for s in stop if s in text]
    if not hits:
        return text, None
    start, _, s = min(hits)
    return text[: start + len(s) if include else start], s


@pytest.mark.parametrize("seed", range(4))
def test_same_output_whatever_the_chunking(seed):
    rnd = random.Random(seed)
    for _ in range(2000):
        alpha = rnd.choice(["ab", "abc"])
        stop = ["".join(rnd.choice(alpha) for _ in range(rnd.randint(1, 6))) for _ in range(rnd.randint(1, 4))]
        text = "".join(rnd.choice(alpha) for _ in range(rnd.randint(0, 30)))
        include = rnd.random() < 0.5
        chunks, i = [], 0
        while i < len(text):
            k = rnd.randint(0, 5)
            chunks.append(text[i:i + k])
            i += k
        checker = StopChecker(stop, include)
        got = "".join(checker.push(c)[0] for c in chunks)
        tail, matched = checker.flush()
        assert (got + tail, matched) == reference(text, stop, include), (stop, include, chunks)
