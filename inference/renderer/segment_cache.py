"""Segment-level tokenization cache: a prompt's ids assembled from the cached ids of its text between added tokens.

Why it is exact. ``tokenizers`` (the Rust library behind every fast tokenizer) first splits the input at the
occurrences of the added tokens that are matched on the raw text (``AddedVocabulary``, the tokens with
``normalized=False``; leftmost-longest), and normalizes, pre-tokenizes and runs the model on each piece between
them on its own; the post-processor (BOS/EOS template) runs once on the joined result. So the ids of any
substring that starts and ends at such a boundary are the same whether it is encoded alone or inside the whole
prompt, *unless* a step looks past its piece: Metaspace ``prepend_scheme="first"`` (only the piece at offset 0
gets the ``▁``), an added token whose ``lstrip``/``rstrip`` eats whitespace across the boundary, or
``single_word`` looking at the neighbours. Byte-level BPE merges never cross an added token anyway.

What is cut. ``SegmentSplitter`` finds the raw-text added tokens with a leftmost-longest literal regex over all
of them (``literal_trie_regex``, the same matching), and cuts at the occurrences of the non-whitespace ones
without ``lstrip``/``rstrip``/``single_word`` (whitespace-only added tokens, Gemma3's ``\\n`` runs, stay inside
segments: cutting there would make many tiny pieces). A segment of at least ``min_chars`` characters is looked up
in the cache by ``(tokenizer fingerprint, variant, blake2b-128 of its UTF-8)``; the text between two cached
segments (the template's markup and short turns) is encoded in one call, uncached. The post-processor is applied
once, as the fixed ``prefix``/``suffix`` ids it adds (derived at load from a probe).

When it is used. ``build_splitter`` runs a self-check at load (``SELF_CHECK_TEXTS`` fragments joined with the
tokenizer's own added tokens, every boundary cut, both ``add_special_tokens`` values) and reports ``ok=False``
with the reason when any text encodes differently from the whole-prompt encoding, or when an added token has
boundary-sensitive flags; such a tokenizer is always encoded whole (``LoadedTokenizer.encode``).

Storage: one bounded LRU per process (``SegmentLRU``, ``SEGMENT_CACHE_MAX_TOKENS`` ids in all, 4 bytes each), not
Redis: a hit costs about a microsecond here against a 0.15-1 ms Redis round trip (docs/DECISIONS.md D-221,
``bench/segment_cost.py``). Counters: ``STATS`` (per thread, reset by each render task and returned with its result;
``inference.tasks`` adds them to the shared Redis counters that ``/metrics`` shows as
``render_segment_cache_hits_total`` / ``render_segment_cache_misses_total``).
"""

from __future__ import annotations

import hashlib
import random
import re
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import tokenizers

from inference.config import SETTINGS

SEGMENT_CACHE_MAX_TOKENS = SETTINGS.segment_cache_max_tokens
SEGMENT_CACHE_MIN_CHARS = SETTINGS.segment_cache_min_chars


# Fragments of the self-check: unicode, whitespace runs, leading/trailing spaces, digits, the Metaspace mark.
SELF_CHECK_TEXTS = (
    "Hello world", " leading space", "trailing space ", "  two  spaces  ", "\n", "\n\n", " \n \n", "\t tab\t",
    "日本語のテキストです。", "emoji 🎉🙂👍🏽", "e\u0301 combining é", "1234567890", "mixed 123abc ABC",
    "\u2581meta \u2581\u2581", " ", "\r\n", "  ", "Ünïcödé ßtraße", "a", "user\n", "x y", "'s 're",
)


class _Stats(threading.local):
    """Per-thread tallies since the last ``reset``: segments hit/missed and their token counts."""

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0

    def reset(self) -> None:
        self.hits = 0
        self.misses = 0

    def snapshot(self) -> dict[str, int]:
        """``{"hits": n, "misses": n}`` of this thread since the last ``reset``."""
        return {"hits": self.hits, "misses": self.misses}


STATS = _Stats()


class SegmentLRU:
    """A process-wide least-recently-used map ``key -> ids`` bounded by the total number of ids held.

    ``max_tokens``: ids held at most (4 bytes each plus about 150 bytes per entry); 0 disables it (``get`` misses,
    ``put`` drops). Thread-safe (the api's inline render pool shares it between threads).
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max(0, int(max_tokens))
        self.tokens = 0
        self._data: OrderedDict[tuple[str, str, bytes], array[int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: tuple[str, str, bytes]) -> array[int] | None:
        """The ids stored under ``key`` (marked most recent), or None."""
        with self._lock:
            ids = self._data.get(key)
            if ids is not None:
                self._data.move_to_end(key)
            return ids

    def put(self, key: tuple[str, str, bytes], ids: array[int]) -> None:
        """Store ``ids`` under ``key``, evicting the least recent entries beyond ``max_tokens``; an entry larger
        than the whole bound is not stored."""
        if len(ids) > self.max_tokens:
            return
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self.tokens -= len(old)
            self._data[key] = ids
            self.tokens += len(ids)
            while self.tokens > self.max_tokens:
                _, dropped = self._data.popitem(last=False)
                self.tokens -= len(dropped)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._data.clear()
            self.tokens = 0


CACHE = SegmentLRU(SEGMENT_CACHE_MAX_TOKENS)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def cached_encode(encode: Callable[[str], list[int]], fingerprint: str, variant: str, text: str,
                  cache: SegmentLRU | None = None) -> list[int]:
    """Ids of ``text`` from the cache under ``(fingerprint, variant, digest(text))``, else ``encode(text)``
    stored there. Counts the hit or miss in ``STATS``; a disabled cache
    (``max_tokens == 0``) just encodes, uncounted."""
    cache = CACHE if cache is None else cache
    if cache.max_tokens == 0:
        return encode(text)
    key = (fingerprint, variant, _digest(text))
    hit = cache.get(key)
    if hit is not None:
        STATS.hits += 1
        return hit.tolist()
    ids = encode(text)
    cache.put(key, array("I", ids))
    STATS.misses += 1
    return ids


@dataclass(frozen=True)
class SegmentSplitter:
    """How one tokenizer's text may be cut into independently encoded segments (built by ``build_splitter``).

    Attributes:
        fingerprint: the tokenizer's identity in cache keys (blake2b of its final ``tokenizer.json`` text and
            ``tokenizer_config.json``): a new revision never reads an old one's entries.
        ok: the self-check passed; when False the tokenizer is always encoded whole and ``reason`` says why.
        regex: leftmost-longest matcher of every raw-text (``normalized=False``) added token, or None.
        cut_tokens: the matched token strings at which text is cut.
        prefix/suffix: ids the post-processor adds around a single sequence (``add_special_tokens=True``).
    """

    fingerprint: str
    ok: bool
    reason: str
    regex: re.Pattern[str] | None
    cut_tokens: frozenset[str]
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    def segments(self, text: str) -> list[tuple[int, int]]:
        """``(start, end)`` of the text between consecutive cut-token occurrences (empty ones included), in
        order; the cut tokens themselves lie between them."""
        out: list[tuple[int, int]] = []
        pos = 0
        if self.regex is not None:
            for m in self.regex.finditer(text):
                if m.group() in self.cut_tokens:
                    out.append((pos, m.start()))
                    pos = m.end()
        out.append((pos, len(text)))
        return out

    def encode(self, tok: tokenizers.Tokenizer, text: str, add_special_tokens: bool, *,
               min_chars: int = SEGMENT_CACHE_MIN_CHARS, cache: SegmentLRU | None = None) -> list[int]:
        """Ids of ``text`` equal to ``tok.encode(text, add_special_tokens).ids``: segments of at least
        ``min_chars`` characters from the cache, the text between them encoded in one call each, then the
        post-processor's ``prefix``/``suffix`` when ``add_special_tokens``. Only for ``ok`` splitters."""
        ids: list[int] = list(self.prefix) if add_special_tokens else []

        def plain(s: str) -> list[int]:
            return tok.encode(s, add_special_tokens=False).ids

        pending = 0
        for start, end in self.segments(text):
            if end - start >= min_chars:
                if start > pending:
                    ids += plain(text[pending:start])
                ids += cached_encode(plain, self.fingerprint, "full", text[start:end], cache)
                pending = end
        if pending < len(text):
            ids += plain(text[pending:])
        if add_special_tokens:
            ids += self.suffix
        return ids


def literal_trie_regex(strings: tuple[str, ...] | list[str]) -> re.Pattern[str]:
    """A compiled regex matching any of ``strings`` (literals), built as a trie so that a search costs about
    one pass over the text however many strings there are (DeepSeek-V3 has 804 special tokens). At a given
    start the longest string wins, and ``finditer`` scans left to right: the leftmost-longest matching of the
    ``tokenizers`` added vocabulary (Aho-Corasick ``LeftmostLongest``)."""
    trie: dict[str, Any] = {}
    for s in strings:
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return re.compile(build(trie))


def _post_ids(tok: tokenizers.Tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The ids the post-processor puts before and after a single sequence, from the probe ``"a"``; None when
    the plain ids are not a contiguous part of the processed ones."""
    with_specials = tok.encode("a", add_special_tokens=True).ids
    plain = tok.encode("a", add_special_tokens=False).ids
    for i in range(len(with_specials) - len(plain) + 1):
        if with_specials[i:i + len(plain)] == plain:
            return tuple(with_specials[:i]), tuple(with_specials[i + len(plain):])
    return None


def _check_texts(cut: list[str], inner: list[str], seed: int = 0) -> list[str]:
    """The self-check battery: each fragment alone, around, before and after cut tokens, cut tokens side by
    side, and seeded random joins of fragments, cut tokens and the other added tokens (``inner``)."""
    frags = list(SELF_CHECK_TEXTS)
    tokens = cut[:] or [""]
    texts = list(frags)
    for i, f in enumerate(frags):
        t = tokens[i % len(tokens)]
        t2 = tokens[(i * 7 + 3) % len(tokens)]
        g = frags[(i + 5) % len(frags)]
        texts += [t + f, f + t, f + t + g, t + f + t2, t + t2 + f, f + t + t2 + g]
    rng = random.Random(seed)
    pool = frags + tokens + inner
    for _ in range(40):
        texts.append("".join(rng.choice(pool) for _ in range(rng.randint(2, 8))))
    return texts


def build_splitter(tok: tokenizers.Tokenizer, fingerprint: str) -> SegmentSplitter:
    """Decide, for ``tok``, whether segmented encoding equals whole encoding, and how to cut.

    Refused (``ok=False``) when a raw-text added token has ``lstrip``/``rstrip``/``single_word`` set (the
    cut would move whitespace across the boundary), when the post-processor's additions are not a fixed
    prefix/suffix, or when any self-check text (``_check_texts``) encodes differently cut at every boundary
    (``min_chars=0``, no cache) than whole, with or without special tokens. Never raises for a loadable tokenizer.
    """
    added = list(tok.get_added_tokens_decoder().values())
    raw = [a for a in added if not a.normalized]
    flagged = [a.content for a in raw if a.lstrip or a.rstrip or a.single_word]

    def refused(reason: str) -> SegmentSplitter:
        return SegmentSplitter(fingerprint, False, reason, None, frozenset(), (), ())

    if flagged:
        return refused(f"added tokens with lstrip/rstrip/single_word: {flagged[:3]}")
    post = _post_ids(tok)
    if post is None:
        return refused("the post-processor's additions are not a fixed prefix/suffix")
    contents = sorted({a.content for a in raw if a.content})
    cut = frozenset(c for c in contents if c.replace("\u2581", " ").strip())
    regex = literal_trie_regex(contents) if contents else None
    splitter = SegmentSplitter(fingerprint, True, "", regex, cut, post[0], post[1])
    inner = sorted({a.content for a in added} - cut)[:16]
    scratch = SegmentLRU(0)
    for text in _check_texts(sorted(cut)[:24], inner):
        for specials in (False, True):
            whole = tok.encode(text, add_special_tokens=specials).ids
            if splitter.encode(tok, text, specials, min_chars=0, cache=scratch) != whole:
                return refused(f"self-check: {text!r} (add_special_tokens={specials}) encodes differently when cut")
    return splitter
