"""Stop-string cost in the api process (issue 14): CPU of detokenizing + stop-checking one choice.

Runs the real ``IncrementalDetokenizer`` (qwen3 tokenizer under ``.cache/tokenizers``) and ``StopChecker`` on
``--tokens`` output tokens pushed one by one, as ``GenerationRun`` does for a streamed chat, once without
stop strings and once with two stop strings of ``--stop-len`` characters (default: the cap,
``MAX_STOP_STRING_LEN``), and prints the CPU seconds of each, their difference and ratio.

Two stop-string shapes: ``random`` (random letters: rarely a partial match) and ``adversarial`` (the output is
one repeated word and each stop string is that word repeated, then a final character that never comes: every
push extends a partial match as long as the stop string, the worst case for the partial-match check).

Usage::

    .venv/bin/python bench/stop_strings.py [--tokens 1900] [--stop-len 1024] [--repeat 3]

Goal (issue 14): two stop strings at the cap cost under 0.2 s of CPU more than none, at 1,900 tokens.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from inference.output_processor import IncrementalDetokenizer, StopChecker
from inference.protocol.openai import MAX_STOP_STRING_LEN
from inference.renderer.tokenizer_cache import get_tokenizer


def run_once(tok, prompt: list[int], output: list[int], stop: list[str] | None) -> tuple[float, str]:
    """CPU seconds to push ``output`` one token at a time through a detokenizer and a stop checker."""
    t0 = time.process_time()
    detok = IncrementalDetokenizer(tok, prompt)
    stops = StopChecker(stop)
    parts = []
    for t in output:
        emit, matched = stops.push(detok.push([t]))
        parts.append(emit)
        if matched:
            break
    parts.append(stops.push(detok.flush())[0])
    parts.append(stops.flush()[0])
    return time.process_time() - t0, "".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1900)
    ap.add_argument("--stop-len", type=int, default=MAX_STOP_STRING_LEN)
    ap.add_argument("--repeat", type=int, default=3, help="runs per case; the fastest is reported")
    args = ap.parse_args()
    tok = get_tokenizer(str(REPO / ".cache" / "tokenizers" / "qwen3"))
    prompt = tok.encode("Write a long story.")
    rnd = random.Random(0)
    words = " ".join(rnd.choice(["alpha", "beta", "gamma", "delta", "story", "the", "of"]) for _ in range(4000))
    cases = {
        "random": (tok.encode(words)[: args.tokens],
                   ["".join(rnd.choice("abcdefghij") for _ in range(args.stop_len)) for _ in range(2)]),
        "adversarial": (tok.encode(" ab" * args.tokens)[: args.tokens],
                        [(" ab" * args.stop_len)[: args.stop_len - 1] + "#",
                         (" ab" * args.stop_len)[1: args.stop_len] + "%"]),
    }
    print(f"{args.tokens} tokens pushed one by one, 2 stop strings of {args.stop_len} chars")
    for name, (output, stop) in cases.items():
        base = min(run_once(tok, prompt, output, None)[0] for _ in range(args.repeat))
        with_stops, text = min((run_once(tok, prompt, output, stop) for _ in range(args.repeat)),
                               key=lambda r: r[0])
        print(f"{name:12s} no stops {base:.3f} s   with stops {with_stops:.3f} s   "
              f"difference {with_stops - base:+.3f} s   ratio {with_stops / base:.2f}x   "
              f"({len(text)} chars out)")


if __name__ == "__main__":
    main()
