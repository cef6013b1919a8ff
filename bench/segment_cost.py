"""Where to keep the segment tokenization cache: encode cost vs an in-process hit vs a Redis round trip, per size.

For segments of about 8 to 8,000 tokens of chat-like prose (Qwen3, Gemma3 and DeepSeek-V3 tokenizers) it times,
in this process, median of repeated runs:

* ``encode``: ``tokenizers`` encode of the segment (what a miss, or no cache, costs);
* ``hit``: ``segment_cache.cached_encode`` hit: blake2b of the text + LRU lookup + ids to a list;
* ``redis``: a Redis ``GET`` of the ids (4 bytes each) + blake2b + decode to a list, over loopback (what a shared
  Redis cache would cost per segment, one round trip each; an ``MGET`` of all segments would pay one per prompt).

The ratio encode/redis says from which size a shared Redis cache would beat re-encoding; hit/redis how much the
in-process cache saves over it. Needs Redis (``--redis-url``, default redis://127.0.0.1:6379/15; the one key it
writes is deleted).

Usage::

    .venv/bin/python bench/segment_cost.py [--redis-url redis://127.0.0.1:6379/15]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import time
from array import array
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from bench.multiturn import turn_text
from inference.renderer.segment_cache import SegmentLRU, cached_encode
from inference.renderer.tokenizer_cache import get_tokenizer


def timed(fn, repeat: int) -> float:
    """Median microseconds of ``fn()`` over ``repeat`` runs."""
    xs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    ap.add_argument("--names", default="qwen3,gemma3,deepseek_v3")
    args = ap.parse_args()
    r = redis.Redis.from_url(args.redis_url)
    key = "bench:segment_cost:ids"
    rng = random.Random(1)
    print(f"{'tokenizer':<12} {'tokens':>6} {'encode us':>10} {'hit us':>8} {'redis us':>9} {'encode/redis':>13} "
          f"{'redis/hit':>10}")
    try:
        for name in args.names.split(","):
            tok = get_tokenizer(str(REPO / ".cache" / "tokenizers" / name))
            for target in (8, 32, 128, 512, 2048, 8192):
                text = turn_text(rng, target)
                ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
                repeat = 200 if target <= 512 else 30
                enc = timed(lambda tok=tok, text=text: tok.tokenizer.encode(text, add_special_tokens=False).ids,
                            repeat)
                cache = SegmentLRU(1 << 20)
                cached_encode(lambda s, tok=tok: tok.tokenizer.encode(s, add_special_tokens=False).ids, "fp", "full",
                              text, cache)
                hit = timed(lambda text=text, cache=cache: cached_encode(lambda s: [], "fp", "full", text, cache),
                            repeat)
                r.set(key, array("I", ids).tobytes())

                def from_redis(text: str = text) -> list[int]:
                    hashlib.blake2b(text.encode(), digest_size=16).digest()
                    out = array("I")
                    out.frombytes(r.get(key) or b"")
                    return out.tolist()

                red = timed(from_redis, repeat)
                print(f"{name:<12} {len(ids):>6} {enc:>10.0f} {hit:>8.1f} {red:>9.0f} {enc / red:>13.2f} "
                      f"{red / hit:>10.0f}")
    finally:
        r.delete(key)


if __name__ == "__main__":
    main()
