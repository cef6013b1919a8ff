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
in the cache by ``(tokenizer fingerprint, variant, blake2b-128 of its UTF-8 keyed with the request's cache
salt)``; the text between two cached segments (the template's markup and short turns) is encoded in one call,
uncached. The post-processor is applied once, as the fixed ``prefix``/``suffix`` ids it adds (derived at load
from a probe).

When it is used. ``build_splitter`` runs a self-check at load (``SELF_CHECK_TEXTS`` fragments joined with the
tokenizer's own added tokens, every boundary cut, both ``add_special_tokens`` values) and reports ``ok=False``
with the reason when any text encodes differently from the whole-prompt encoding, or when an added token has
boundary-sensitive flags; such a tokenizer is always encoded whole (``LoadedTokenizer.encode``).

Storage: one bounded LRU per process first (``SegmentLRU``, ``SEGMENT_CACHE_MAX_TOKENS`` ids in all, 4 bytes each):
a hit costs about a microsecond here against a 0.15-1 ms Redis round trip (docs/DECISIONS.md D-221,
docs/bench-results.md). Behind it, in render workers, a shared tier in Redis (``SharedTier``, D-303): the segments
of at least ``SEGMENT_CACHE_REDIS_MIN_CHARS`` characters that one prompt misses locally are fetched in one ``MGET``,
and those still missing are encoded and written back in the task's reply pipeline (``take_shared_writes``; no extra
round trip; on a Redis of the tier's own, ``SEGMENT_CACHE_REDIS_URL``, right after the reply), to live
``SEGMENT_CACHE_REDIS_TTL_S`` seconds. It pays when a conversation's turns reach several render
workers, which local caches alone serve less well the more workers there are. Counters: ``STATS`` (per thread, reset
by each render task and returned with its result; ``inference.workers.tasks`` adds them to the shared Redis counters that
``/metrics`` shows as ``render_segment_cache_hits_total`` (either tier), ``render_segment_cache_shared_hits_total``
(of those, from Redis) and ``render_segment_cache_misses_total``).
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
import sys
import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import tokenizers
from redis.exceptions import RedisError

from inference.shared.config import SETTINGS

SEGMENT_CACHE_MAX_TOKENS = SETTINGS.segment_cache_max_tokens
SEGMENT_CACHE_MIN_CHARS = SETTINGS.segment_cache_min_chars
SEGMENT_CACHE_REDIS_MIN_CHARS = SETTINGS.segment_cache_redis_min_chars
SEGMENT_CACHE_REDIS_TTL_S = SETTINGS.segment_cache_redis_ttl_s

logger = logging.getLogger(__name__)


# Fragments of the self-check: unicode, whitespace runs, leading/trailing spaces, digits, the Metaspace mark.
SELF_CHECK_TEXTS = (
    "Hello world", " leading space", "trailing space ", "  two  spaces  ", "\n", "\n\n", " \n \n", "\t tab\t",
    "日本語のテキストです。", "emoji 🎉🙂👍🏽", "e\u0301 combining é", "1234567890", "mixed 123abc ABC",
    "\u2581meta \u2581\u2581", " ", "\r\n", "  ", "Ünïcödé ßtraße", "a", "user\n", "x y", "'s 're",
)


class _Stats(threading.local):
    """Per-thread tallies of segments since the last ``reset``: ``hits`` (ids from either tier), ``shared_hits`` (of
    those, from the shared tier) and ``misses`` (encoded)."""

    def __init__(self) -> None:
        self.hits = 0
        self.shared_hits = 0
        self.misses = 0

    def reset(self) -> None:
        self.hits = 0
        self.shared_hits = 0
        self.misses = 0

    def snapshot(self) -> dict[str, int]:
        """``{"hits": n, "misses": n}`` of this thread since the last ``reset``, with ``"shared_hits": n`` when
        any came from the shared tier."""
        out = {"hits": self.hits, "misses": self.misses}
        if self.shared_hits:
            out["shared_hits"] = self.shared_hits
        return out


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


def _digest(text: str, salt: bytes = b"") -> bytes:
    """blake2b-128 of ``text``'s UTF-8, keyed with ``salt`` (at most 64 bytes; empty: unkeyed)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16, key=salt).digest()


def salt_key(cache_salt: str | None) -> bytes:
    """The blake2b key of a request's cache salt: its bytes when it is hex of 1-64 bytes
    (``gateway.pipeline.inputs.cache_salt_for`` gives 64 hex characters, 32 bytes), else its SHA-256; empty for
    none."""
    if not cache_salt:
        return b""
    try:
        raw = bytes.fromhex(cache_salt)
    except ValueError:
        raw = b""
    return raw if 0 < len(raw) <= 64 else hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).digest()


# Version of the shared tier's keys: the entry layout and the ``tokenizers`` release that encoded it (a worker of
# another release or code version never reads ids it might encode differently, e.g. during a rolling deploy)
SHARED_KEY_VERSION = f"v1-{tokenizers.__version__}"
SHARED_FAILURE_BACKOFF_S = 5.0  # after a failed read, the tier is skipped this long (no wait or log per render)
SHARED_WRITE_BUDGET_BYTES = 1 << 20  # ids one task may write to the tier (1 MiB: 262,144 tokens)


class SharedTier:
    """The segment cache's second tier: ids in Redis, shared by every render worker of one platform (D-303).

    ``client``: a callable returning a synchronous ``redis.Redis`` (made on first use; give it short socket timeouts
    and no retries, as ``inference.workers.tasks`` does); ``min_chars``: segments shorter than this are never looked up or
    stored here (encoding them costs less than the round trip); ``ttl_s``: seconds an entry lives after it is
    written. Keys: ``<namespace>:segcache:<SHARED_KEY_VERSION>:<fingerprint>:<variant>:<digest hex>`` (the digest
    keyed with the request's cache salt), values the ids as little-endian 32-bit integers. The namespace (the
    platform's link prefix) is set per task by ``shared_scope``; with none set, or no cache salt, the tier is
    skipped. Redis holds the ids of the distinct long segments written within ``ttl_s`` (4 bytes a token, about the
    size of their text), at most ``SHARED_WRITE_BUDGET_BYTES`` per task: its size follows the rate of new long text.
    The platform's Redis must not evict (admission leases, usage streams), so where that rate is large the tier gets
    a Redis of its own with ``maxmemory`` and ``allkeys-lru`` (``SEGMENT_CACHE_REDIS_URL``, ``deploy/README.md``).
    A failed or timed-out read makes the segments misses, queues no writes, and turns the tier off for
    ``SHARED_FAILURE_BACKOFF_S`` (logged once per back-off); it never fails a render.
    """

    def __init__(self, client: Callable[[], Any], min_chars: int, ttl_s: int) -> None:
        self.client = client
        self.min_chars = max(1, int(min_chars))
        self.ttl_s = max(1, int(ttl_s))
        self._down_until = 0.0

    def key(self, namespace: str, fingerprint: str, variant: str, digest: bytes) -> str:
        """The Redis key of one segment's ids."""
        return f"{namespace}:segcache:{SHARED_KEY_VERSION}:{fingerprint}:{variant}:{digest.hex()}"

    def available(self) -> bool:
        """False while the tier is backing off after a failed read."""
        return time.monotonic() >= self._down_until

    def fetch(self, keys: list[str]) -> list[array[int] | None]:
        """The ids stored under each of ``keys`` (one ``MGET``), None where absent or malformed; all None after a
        Redis or socket error (then the tier backs off, ``SHARED_FAILURE_BACKOFF_S``)."""
        try:
            values = self.client().mget(keys)
        except (RedisError, OSError, ValueError):  # ValueError: a client that cannot be made (a malformed URL)
            if self.available():
                logger.warning("segment cache: the shared tier could not be read; encoding instead for %.0f s",
                               SHARED_FAILURE_BACKOFF_S, exc_info=True)
            self._down_until = time.monotonic() + SHARED_FAILURE_BACKOFF_S
            return [None] * len(keys)
        out: list[array[int] | None] = []
        for value in values:
            if not isinstance(value, bytes) or not value or len(value) % 4:
                out.append(None)
                continue
            ids = array("I")
            ids.frombytes(value)
            if sys.byteorder != "little":
                ids.byteswap()
            out.append(ids)
        return out


def _as_bytes(ids: array[int]) -> bytes:
    if sys.byteorder == "little":
        return ids.tobytes()
    swapped = array("I", ids)
    swapped.byteswap()
    return swapped.tobytes()


class _TaskScope(threading.local):
    """This thread's shared-tier namespace (None: no shared tier), the entries it has yet to write, and the key of
    the current request's cache scope (``salt_scope``)."""

    def __init__(self) -> None:
        self.namespace: str | None = None
        self.writes: list[tuple[str, bytes]] = []
        self.write_bytes = 0
        self.salt = b""


_SCOPE = _TaskScope()
SHARED: SharedTier | None = None


def enable_shared_tier(client: Callable[[], Any], min_chars: int = SEGMENT_CACHE_REDIS_MIN_CHARS,
                       ttl_s: int = SEGMENT_CACHE_REDIS_TTL_S) -> SharedTier | None:
    """Give this process the shared tier (render workers call it at start, ``inference.workers.tasks``); ``min_chars`` 0
    or a local cache turned off (``SEGMENT_CACHE_MAX_TOKENS`` 0) leaves it off. Returns the tier or None."""
    global SHARED
    SHARED = SharedTier(client, min_chars, ttl_s) if min_chars > 0 and CACHE.max_tokens > 0 else None
    return SHARED


def disable_shared_tier() -> None:
    """Take the shared tier away from this process."""
    global SHARED
    SHARED = None


def shared_scope(namespace: str | None) -> None:
    """Start a task on this thread: its shared-tier entries go under ``namespace`` (None: no shared tier for it),
    and the entries an earlier task left unwritten are dropped."""
    _SCOPE.namespace = namespace
    _SCOPE.writes = []
    _SCOPE.write_bytes = 0


def salt_scope(cache_salt: str | None) -> None:
    """Key this thread's next lookups (both tiers) with a request's cache salt (its tenant's cache scope,
    ``gateway.pipeline.inputs.cache_salt_for``), as the engines' prefix caches are: a segment is then shared only
    within one scope, and how fast a prompt is tokenized tells a caller nothing about other tenants' prompts.
    None: unscoped keys (text the platform itself encodes)."""
    _SCOPE.salt = salt_key(cache_salt)


def take_shared_writes() -> list[tuple[str, bytes, int]]:
    """The ``(key, value, ttl_s)`` entries this thread's task encoded for the shared tier, handed over once (the
    caller writes them, e.g. with ``SET key value EX ttl_s`` in the task's reply pipeline)."""
    writes, _SCOPE.writes, _SCOPE.write_bytes = _SCOPE.writes, [], 0
    tier = SHARED
    if tier is None:
        return []
    return [(k, v, tier.ttl_s) for k, v in writes]


def cached_encode_many(encode: Callable[[str], list[int]], fingerprint: str, variant: str, texts: list[str],
                       cache: SegmentLRU | None = None) -> list[list[int]]:
    """The ids of each of ``texts``, each equal to ``encode(text)``, looked up under ``(fingerprint, variant,
    digest(text) keyed with this thread's salt_scope)``: in the local cache; else, for texts of at least the shared
    tier's ``min_chars`` when this thread has a namespace and a cache salt (``shared_scope``, ``salt_scope``), in
    Redis (one ``MGET`` for all of them, stored locally on a hit); else encoded (once per distinct text) and stored
    locally, and those long scoped ones queued for the shared tier (``take_shared_writes``, at most
    ``SHARED_WRITE_BUDGET_BYTES`` a task). Counts hits, shared hits and misses in ``STATS``; a disabled local cache
    (``max_tokens == 0``) just encodes, uncounted."""
    cache = CACHE if cache is None else cache
    if cache.max_tokens == 0:
        return [encode(t) for t in texts]
    salt = _SCOPE.salt
    keys = [(fingerprint, variant, _digest(t, salt)) for t in texts]
    found: dict[tuple[str, str, bytes], array[int]] = {}
    for k in keys:
        ids = cache.get(k)
        if ids is not None:
            found[k] = ids
    STATS.hits += sum(k in found for k in keys)
    tier, namespace = SHARED, _SCOPE.namespace
    shared: dict[tuple[str, str, bytes], str] = {}  # long scoped texts missed locally -> their Redis key
    if tier is not None and namespace is not None and salt and tier.available():
        for k, t in zip(keys, texts):
            if k not in found and k not in shared and len(t) >= tier.min_chars:
                shared[k] = tier.key(namespace, *k)
        if shared:
            remote: set[tuple[str, str, bytes]] = set()
            for k, ids_or_none in zip(list(shared), tier.fetch(list(shared.values()))):
                if ids_or_none is not None:
                    found[k] = ids_or_none
                    cache.put(k, ids_or_none)
                    remote.add(k)
                    del shared[k]
            n = sum(k in remote for k in keys)
            STATS.hits += n
            STATS.shared_hits += n
    out: list[list[int]] = []
    encoded: set[tuple[str, str, bytes]] = set()
    for k, t in zip(keys, texts):
        ids = found.get(k)
        if ids is not None:
            if k in encoded:  # a text repeated in this prompt, encoded at its first occurrence
                STATS.hits += 1
            out.append(ids.tolist())
            continue
        encoded.add(k)
        new = encode(t)
        stored = array("I", new)
        cache.put(k, stored)
        found[k] = stored
        STATS.misses += 1
        if k in shared and tier is not None and tier.available():  # not after a failed read: Redis is not answering
            _queue_write(shared.pop(k), stored)
        out.append(new)
    return out


def _queue_write(key: str, ids: array[int]) -> None:
    """Queue one shared-tier entry for this thread's task, within ``SHARED_WRITE_BUDGET_BYTES``."""
    value = _as_bytes(ids)
    if _SCOPE.write_bytes + len(value) <= SHARED_WRITE_BUDGET_BYTES:
        _SCOPE.writes.append((key, value))
        _SCOPE.write_bytes += len(value)


def cached_encode(encode: Callable[[str], list[int]], fingerprint: str, variant: str, text: str,
                  cache: SegmentLRU | None = None) -> list[int]:
    """``cached_encode_many`` of one text: its ids from either tier, else ``encode(text)`` stored there."""
    return cached_encode_many(encode, fingerprint, variant, [text], cache)[0]


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

        pieces: list[tuple[bool, str]] = []  # (from the cache, text) in order
        pending = 0
        for start, end in self.segments(text):
            if end - start >= min_chars:
                if start > pending:
                    pieces.append((False, text[pending:start]))
                pieces.append((True, text[start:end]))
                pending = end
        if pending < len(text):
            pieces.append((False, text[pending:]))
        cached = iter(cached_encode_many(plain, self.fingerprint, "full", [t for c, t in pieces if c], cache))
        for from_cache, piece in pieces:
            ids += next(cached) if from_cache else plain(piece)
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
