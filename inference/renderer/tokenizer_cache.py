"""Per-process tokenizer cache over the Rust ``tokenizers`` library (no ``transformers`` at run time).

``get_tokenizer(dir)`` loads ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``chat_template.jinja``)
once per process and returns a ``LoadedTokenizer`` whose ``encode``/``decode`` give the same ids/text
as ``transformers.AutoTokenizer.from_pretrained(dir)`` (5.24, fast backend) for the same files.

What transformers 5.24 does on top of ``tokenizer.json`` that we reproduce (checked in
``tests/renderer/test_tokenizer_cache.py`` against the real AutoTokenizer):

* ``tokenizer_class`` ``LlamaTokenizer``/``LlamaTokenizerFast`` with a non-ByteLevel (SentencePiece
  style) ``tokenizer.json`` is rebuilt by ``transformers/models/llama/tokenization_llama.py``: no
  normalizer, a ``Metaspace(replacement="▁", prepend_scheme=always|first|never, split=False)``
  pre-tokenizer (``always`` when ``add_prefix_space`` is unset/true and ``legacy`` is true, ``first``
  when ``legacy`` is false, ``never`` when ``add_prefix_space`` is false) and a BPE model without
  ``unk_token``. This changes ids, e.g. ``" leading"`` no longer gets an extra ``"▁"`` token.
* Named special tokens (``bos_token`` ... ``mask_token`` and ``extra_special_tokens``), including
  the tokenizer class' defaults (``GemmaTokenizer``: ``mask_token="<mask>"``), are special: they are
  skipped by ``decode(skip_special_tokens=True)`` even where ``tokenizer.json`` marks them non-special.
* ``clean_up_tokenization_spaces`` is ignored for BPE models (transformers 5 skips it with a
  warning); applied only for other model types.
* ``add_bos_token``/``add_eos_token``: transformers 5 keeps the ``tokenizer.json`` post-processor
  for these files, so ``encode(add_special_tokens=True)`` is exactly the post-processor's output;
  the ``add_bos_token`` attribute reports what that post-processor really does.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import tokenizers

from .errors import TokenIdError, TokenizerLoadError
from .segment_cache import CACHE as SEGMENT_CACHE
from .segment_cache import SEGMENT_CACHE_MIN_CHARS
from .segment_cache import SegmentSplitter, build_splitter, cached_encode_many, literal_trie_regex

# transformers' SPECIAL_TOKENS_ATTRIBUTES (tokenization_utils_base.py), in its order.
SPECIAL_TOKEN_ATTRIBUTES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Defaults of tokenizer classes' __init__ (transformers 5.24), used when the config omits the key.
_CLASS_DEFAULTS: dict[str, dict[str, str]] = {
    "GemmaTokenizer": {
        "unk_token": "<unk>",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "mask_token": "<mask>",
    },
    "LlamaTokenizer": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
}


def _token_str(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, an AddedToken dict or null."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        content: str | None = value["content"]
        return content
    return None


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (spaces before punctuation and English contractions)."""
    for a, b in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(a, b)
    return text


def _is_byte_level(tok_json: dict[str, Any]) -> bool:
    def has_bl(node: Any) -> bool:
        if isinstance(node, dict):
            if node.get("type") == "ByteLevel":
                return True
            return any(has_bl(v) for v in node.values())
        if isinstance(node, list):
            return any(has_bl(v) for v in node)
        return False

    return has_bl(tok_json.get("pre_tokenizer")) or has_bl(tok_json.get("decoder"))


def _llama_rewrite(tok_json: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Apply transformers 5's LlamaTokenizer rebuild to a SentencePiece-style tokenizer.json."""
    add_prefix_space = config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    if add_prefix_space:
        scheme = "always" if config.get("legacy", True) else "first"
    else:
        scheme = "never"
    tok_json = dict(tok_json)
    tok_json["normalizer"] = None
    tok_json["pre_tokenizer"] = {
        "type": "Metaspace",
        "replacement": "\u2581",
        "prepend_scheme": scheme,
        "split": False,
    }
    model = dict(tok_json["model"])
    model["unk_token"] = None
    tok_json["model"] = model
    decoders = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_prefix_space:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    tok_json["decoder"] = {"type": "Sequence", "decoders": decoders}
    return tok_json


@dataclass
class LoadedTokenizer:
    """A tokenizer directory loaded once: the Rust tokenizer plus its parsed ``tokenizer_config.json``.

    Attributes:
        path: real path of the directory.
        tokenizer: the ``tokenizers.Tokenizer`` (after the transformers-5 rewrites described above).
        config: parsed ``tokenizer_config.json`` (``{}`` when absent).
        special_tokens_map: named special tokens ``{"bos_token": "<s>", ...}`` (strings only,
            None omitted), what transformers passes to chat templates.
        bos_token/eos_token/pad_token/unk_token: strings or None; ``*_token_id`` their ids or None.
        chat_template: the default template string or None; ``chat_templates``: named templates
            (``{"default": ..., "tool_use": ...}``) when the config has a list of them.
        vocab_size: full size including added tokens (ids are valid in ``[0, vocab_size)``).
        all_special_ids: ids of named + additional special tokens (transformers' order).
        max_token_chars: the longest token string in characters (vocab and added tokens). A text of
            ``c`` characters encodes to at least ``ceil(c / max_token_chars)`` tokens for
            tokenizers without expanding/contracting normalizers (NFC can contract), so it is a
            cheap pre-check bound, not an exact count.
        add_bos_token: whether ``encode(add_special_tokens=True)`` starts with BOS.
        control_tokens: the strings of the added tokens of ``tokenizer.json``, ``special`` or not (Qwen3's
            ``<think>``/``<tool_call>``, DeepSeek-V3's ``<｜User｜>`` are non-special), except the whitespace-only
            ones (Gemma3's ``\n``/``▁▁``/``\t`` runs: ordinary text pieces), sorted; ``control_regex`` finds them
            (leftmost-longest), ``None`` when there are none.
        segments: how ``encode`` cuts text for the segment cache (``segment_cache.build_splitter``; its ``ok``
            is False, with the reason, for a tokenizer where cut encoding would differ: then always whole).
    """

    path: str
    tokenizer: tokenizers.Tokenizer
    config: dict[str, Any]
    special_tokens_map: dict[str, str]
    chat_template: str | None
    chat_templates: dict[str, str]
    vocab_size: int
    all_special_ids: list[int]
    skip_ids: frozenset[int]
    max_token_chars: int
    add_bos_token: bool
    clean_up_tokenization_spaces: bool
    control_tokens: tuple[str, ...] = ()
    control_regex: re.Pattern[str] | None = None
    segments: SegmentSplitter | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _text_only: tokenizers.Tokenizer | None = field(default=None, repr=False)

    # -- special tokens -------------------------------------------------------------------------
    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self.special_tokens_map.get("unk_token")

    def token_to_id(self, token: str | None) -> int | None:
        """Id of a token string, or None if absent."""
        if token is None:
            return None
        return self.tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self.token_to_id(self.unk_token)

    # -- encode / decode ------------------------------------------------------------------------
    def segment_cache_on(self) -> bool:
        """Whether ``encode`` assembles ids from the segment cache (it is enabled and this tokenizer passed the
        self-check of ``segment_cache.build_splitter``)."""
        return SEGMENT_CACHE.max_tokens > 0 and self.segments is not None and self.segments.ok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; identical to ``AutoTokenizer(text, add_special_tokens=...)["input_ids"]``.

        Text of at least twice ``SEGMENT_CACHE_MIN_CHARS`` is encoded by segments through the segment cache when
        ``segment_cache_on()`` (the same ids, see ``segment_cache``), else in one call."""
        if len(text) >= 2 * SEGMENT_CACHE_MIN_CHARS and self.segment_cache_on():
            assert self.segments is not None
            return self.segments.encode(self.tokenizer, text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def check_ids(self, ids: list[int], param: str = "tokens") -> None:
        """Raise ``TokenIdError`` naming the first id that is not an int in ``[0, vocab_size)``."""
        n = self.vocab_size
        for i, t in enumerate(ids):
            if type(t) is not int or t < 0 or t >= n:  # bool is not a token id either
                raise TokenIdError(
                    f"token id {t!r} at index {i} is out of range: valid ids are 0..{n - 1}", param=param
                )

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` like transformers' ``decode``. Raises ``TokenIdError`` for invalid ids."""
        self.check_ids(ids)
        return self.decode_unchecked(ids, skip_special_tokens)

    def decode_unchecked(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """``decode`` without the id range check (ids must already be valid)."""
        if skip_special_tokens:
            ids = [t for t in ids if t not in self.skip_ids]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if self.clean_up_tokenization_spaces:
            text = _clean_up_tokenization(text)
        return text

    # -- control tokens ---------------------------------------------------------------
    def text_only_tokenizer(self) -> tokenizers.Tokenizer:
        """A copy of ``tokenizer`` in which no ``control_tokens`` string is matched: every control token is
        marked ``special`` in the copy and ``encode_special_tokens = True`` (transformers'
        ``split_special_tokens=True``) splits them as ordinary text; that flag alone would still match the
        non-special ones. Other added tokens (whitespace runs) match as in ``tokenizer``. Built on first use,
        once per process; the shared ``tokenizer`` is never switched (other threads encode with it)."""
        with self._lock:
            if self._text_only is None:
                # Re-adding an added token with ``special=True`` keeps its id and its other flags; done in Rust, not by
                # editing the JSON in Python (gemma3: 1.9 s instead of 3.1 s, no transient dicts of 262k entries)
                copy = tokenizers.Tokenizer.from_str(self.tokenizer.to_str())
                control = set(self.control_tokens)
                retag = [tokenizers.AddedToken(a.content, single_word=a.single_word, lstrip=a.lstrip, rstrip=a.rstrip,
                                               normalized=a.normalized, special=True)
                         for a in copy.get_added_tokens_decoder().values() if a.content in control and not a.special]
                if retag:
                    copy.add_special_tokens(retag)
                copy.no_padding()
                copy.no_truncation()
                copy.encode_special_tokens = True
                self._text_only = copy
            return self._text_only

    def encode_with_trusted(self, text: str, trusted: list[tuple[int, int]],
                            add_special_tokens: bool = False) -> list[int]:
        """Ids of ``text`` where only the control-token occurrences at the character spans ``trusted``
        (sorted, non-overlapping ``(start, end)``, each exactly one of ``control_tokens``) become control ids;
        every other character is encoded with special-token matching off.

        Added tokens are split off before the normalizer and pre-tokenizer, so with every occurrence trusted
        this equals ``encode(text)`` (checked on the six reference tokenizers in
        ``tests/security/test_isolation_control_tokens.py``); ``add_special_tokens`` applies the
        post-processor (BOS/EOS) to the joined encoding as ``encode`` would. With ``segment_cache_on()`` the text
        between trusted spans (``"text"`` segments, at least ``SEGMENT_CACHE_MIN_CHARS``) comes from the segment
        cache and the post-processor's prefix/suffix ids are added directly (the same ids)."""
        plain = self.text_only_tokenizer()
        if self.segment_cache_on():
            assert self.segments is not None
            fingerprint = self.segments.fingerprint

            def plain_ids(s: str) -> list[int]:
                return plain.encode(s, add_special_tokens=False).ids

            pieces: list[tuple[str, str]] = []  # ("cached" | "plain" | "trusted", text) in order

            def text_piece(s: str) -> None:
                pieces.append(("cached" if len(s) >= SEGMENT_CACHE_MIN_CHARS else "plain", s))

            pos = 0
            for start, end in trusted:
                if start > pos:
                    text_piece(text[pos:start])
                pieces.append(("trusted", text[start:end]))
                pos = end
            if pos < len(text) or not trusted:
                text_piece(text[pos:])
            cached = iter(cached_encode_many(plain_ids, fingerprint, "text", [s for k, s in pieces if k == "cached"]))
            ids: list[int] = list(self.segments.prefix) if add_special_tokens else []
            for kind, piece in pieces:
                if kind == "cached":
                    ids += next(cached)
                elif kind == "plain":
                    ids += plain_ids(piece)
                else:
                    ids += self.tokenizer.encode(piece, add_special_tokens=False).ids
            if add_special_tokens:
                ids += self.segments.suffix
            return ids
        parts: list[tokenizers.Encoding] = []
        pos = 0
        for start, end in trusted:
            if start > pos:
                parts.append(plain.encode(text[pos:start], add_special_tokens=False))
            parts.append(self.tokenizer.encode(text[start:end], add_special_tokens=False))
            pos = end
        if pos < len(text) or not parts:
            parts.append(plain.encode(text[pos:], add_special_tokens=False))
        merged = tokenizers.Encoding.merge(parts, growing_offsets=True)
        return self.tokenizer.post_process(merged, add_special_tokens=add_special_tokens).ids

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of an id (byte-level/▁ form), or None if out of range."""
        return self.tokenizer.id_to_token(token_id)


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
        return data


@dataclass(frozen=True)
class _TokenizerFiles:
    """What ``_read_tokenizer_files`` reads from a tokenizer directory."""

    tokenizer: tokenizers.Tokenizer  # after the LlamaTokenizer rebuild; no padding, no truncation
    config: dict[str, Any]  # tokenizer_config.json, {} when absent
    base_class: str  # tokenizer_class without its "Fast" suffix ("" when unset)
    fingerprint: str  # blake2b-128 hex of tokenizer.json's text (after the rebuild) and the config


def _read_tokenizer_files(tokenizer_dir: str, real: str) -> _TokenizerFiles:
    """Read ``tokenizer.json`` and ``tokenizer_config.json`` of ``real`` (the real path of ``tokenizer_dir``) into a
    ``tokenizers.Tokenizer``, with transformers 5's LlamaTokenizer rebuild applied (module docstring).

    Raises ``TokenizerLoadError`` when ``tokenizer.json`` is missing or either file is unreadable."""
    tj_path = os.path.join(real, "tokenizer.json")
    cfg_path = os.path.join(real, "tokenizer_config.json")
    try:
        config = _read_json(cfg_path) if os.path.exists(cfg_path) else {}
        base_class = str(config.get("tokenizer_class") or "").removesuffix("Fast")
        with open(tj_path, encoding="utf-8") as f:
            raw = f.read()
        if base_class == "LlamaTokenizer":
            tok_json: dict[str, Any] = json.loads(raw)
            if not _is_byte_level(tok_json):
                raw = json.dumps(_llama_rewrite(tok_json, config))
        tok = tokenizers.Tokenizer.from_str(raw)
        # transformers ignores the padding/truncation a tokenizer.json may carry (all-MiniLM's pads to 128):
        # a prompt is encoded exactly, never padded or cut here (lengths are checked by the caller).
        tok.no_padding()
        tok.no_truncation()
        digest = hashlib.blake2b(raw.encode("utf-8", "surrogatepass"), digest_size=16)
        digest.update(json.dumps(config, sort_keys=True).encode("utf-8", "surrogatepass"))
        return _TokenizerFiles(tokenizer=tok, config=config, base_class=base_class, fingerprint=digest.hexdigest())
    except Exception as exc:  # tokenizers raises plain Exception
        raise TokenizerLoadError(f"cannot load tokenizer from {tokenizer_dir!r}: {exc}") from exc


def _named_special_tokens(config: dict[str, Any], base_class: str) -> tuple[dict[str, str], list[str]]:
    """``(special_tokens_map, additional special tokens)`` as transformers builds them from ``config``: the
    ``SPECIAL_TOKEN_ATTRIBUTES`` (the tokenizer class' defaults where the config omits one), the named
    ``extra_special_tokens`` of a dict, and the strings of an ``extra_special_tokens`` list and of
    ``additional_special_tokens``."""
    defaults = _CLASS_DEFAULTS.get(base_class, {})
    stm: dict[str, str] = {}
    for attr in SPECIAL_TOKEN_ATTRIBUTES:
        value = _token_str(config[attr]) if attr in config else defaults.get(attr)
        if value is not None:
            stm[attr] = value
    extra = config.get("extra_special_tokens")
    additional: list[str] = []
    if isinstance(extra, dict):
        for k, v in extra.items():
            s = _token_str(v)
            if s is not None:
                stm.setdefault(k, s)
    elif isinstance(extra, list):
        additional += [s for s in map(_token_str, extra) if s is not None]
    listed = config.get("additional_special_tokens")
    if isinstance(listed, list):
        additional += [s for s in map(_token_str, listed) if s is not None]
    return stm, additional


def _special_ids(tok: tokenizers.Tokenizer, special: list[str],
                 added: dict[int, tokenizers.AddedToken]) -> tuple[list[int], frozenset[int]]:
    """``(all_special_ids, skip_ids)``: the ids of the ``special`` token strings in order, once each (those not in
    the vocabulary left out), and the ids ``decode(skip_special_tokens=True)`` drops: those plus the ``added``
    tokens (``get_added_tokens_decoder()``) that ``tokenizer.json`` marks special."""
    all_special: list[int] = []
    for s in special:
        i = tok.token_to_id(s)
        if i is not None and i not in all_special:
            all_special.append(i)
    rust_special = {i for i, t in added.items() if t.special}
    return all_special, frozenset(rust_special | set(all_special))


def _read_chat_templates(real: str, config: dict[str, Any]) -> tuple[str | None, dict[str, str]]:
    """``(default chat template or None, named templates)`` of the tokenizer directory ``real``:
    tokenizer_config.json's ``chat_template`` (a string, or a list of ``{name, template}``), then
    ``chat_template.jinja`` (which transformers 5 saves instead, and prefers when present) and the
    ``additional_chat_templates/*.jinja`` files (named by their stems)."""
    chat_template: str | None = None
    named: dict[str, str] = {}
    ct = config.get("chat_template")
    if isinstance(ct, str):
        chat_template = ct
    elif isinstance(ct, list):
        for item in ct:
            if isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str):
                named[item["name"]] = item["template"]
        chat_template = named.get("default")
    jinja_path = os.path.join(real, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            chat_template = f.read()
        if named:
            named["default"] = chat_template
    extra_dir = os.path.join(real, "additional_chat_templates")
    if os.path.isdir(extra_dir):
        for fn in sorted(os.listdir(extra_dir)):
            if fn.endswith(".jinja"):
                with open(os.path.join(extra_dir, fn), encoding="utf-8") as f:
                    named[fn[: -len(".jinja")]] = f.read()
        if chat_template is not None:
            named.setdefault("default", chat_template)
    return chat_template, named


def _adds_bos(tok: tokenizers.Tokenizer, stm: dict[str, str]) -> bool:
    """``add_bos_token``: whether the post-processor puts the BOS token of ``stm`` before an encoding, found by
    encoding ``"a"`` with and without special tokens."""
    probe = tok.encode("a", add_special_tokens=True).ids
    plain = tok.encode("a", add_special_tokens=False).ids
    bos_id = tok.token_to_id(stm["bos_token"]) if "bos_token" in stm else None
    return len(probe) > len(plain) and bos_id is not None and probe[0] == bos_id


def _cleans_up_spaces(config: dict[str, Any], tok: tokenizers.Tokenizer) -> bool:
    """Whether ``decode`` applies ``clean_up_tokenization_spaces``: as the config says, except for BPE models,
    where transformers 5 skips it (unless the config forces it with its long-named override)."""
    cleanup = bool(config.get("clean_up_tokenization_spaces", False))
    if cleanup and type(tok.model).__name__ == "BPE" and not config.get(
        "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
    ):
        cleanup = False
    return cleanup


def load_tokenizer(tokenizer_dir: str) -> LoadedTokenizer:
    """Load a tokenizer directory without caching (see ``get_tokenizer``).

    Raises ``TokenizerLoadError`` when ``tokenizer.json`` is missing or unreadable.
    """
    real = os.path.realpath(tokenizer_dir)
    files = _read_tokenizer_files(tokenizer_dir, real)
    tok, config = files.tokenizer, files.config
    # Named special tokens, as transformers' special_tokens_map.
    stm, additional = _named_special_tokens(config, files.base_class)
    added = tok.get_added_tokens_decoder()
    all_special, skip_ids = _special_ids(tok, list(stm.values()) + additional, added)
    chat_template, named = _read_chat_templates(real, config)
    control = tuple(sorted({t.content for t in added.values() if t.content.replace("\u2581", " ").strip()}))
    max_chars = max((len(s) for s in tok.get_vocab(with_added_tokens=True)), default=1)
    return LoadedTokenizer(
        path=real,
        tokenizer=tok,
        config=config,
        special_tokens_map=stm,
        chat_template=chat_template,
        chat_templates=named,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        all_special_ids=all_special,
        skip_ids=skip_ids,
        max_token_chars=max(1, max_chars),
        add_bos_token=_adds_bos(tok, stm),
        clean_up_tokenization_spaces=_cleans_up_spaces(config, tok),
        control_tokens=control,
        control_regex=literal_trie_regex(control) if control else None,
        segments=build_splitter(tok, files.fingerprint) if SEGMENT_CACHE.max_tokens > 0 else None,
    )



logger = logging.getLogger(__name__)
_CACHE: dict[tuple[str, float, float], LoadedTokenizer] = {}
_CACHE_LOCK = threading.Lock()
_LOADING: dict[tuple[str, float, float], Future[LoadedTokenizer]] = {}  # loads under way, by cache key


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return -1.0


def _cache_key(tokenizer_dir: str) -> tuple[str, float, float]:
    real = os.path.realpath(tokenizer_dir)
    return real, _mtime(os.path.join(real, "tokenizer.json")), _mtime(os.path.join(real, "tokenizer_config.json"))


def cached_tokenizer(tokenizer_dir: str) -> LoadedTokenizer | None:
    """``get_tokenizer(tokenizer_dir)`` when it is loaded already (the same cache key: a path lookup and two
    ``stat`` calls, no lock, no load), else ``None``."""
    return _CACHE.get(_cache_key(tokenizer_dir))


def get_tokenizer(tokenizer_dir: str) -> LoadedTokenizer:
    """The process-wide ``LoadedTokenizer`` of ``tokenizer_dir``.

    Cached by (real path, mtime of tokenizer.json, mtime of tokenizer_config.json): a directory
    replaced in place (new revision) is reloaded, and an old entry for the same path is dropped.
    Thread-safe; concurrent first calls for one directory load it once.
    Raises ``TokenizerLoadError``.
    """
    key = _cache_key(tokenizer_dir)
    real = key[0]
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            return hit
        loading = _LOADING.get(key)
        if loading is None:
            loading = _LOADING[key] = Future()
            threading.Thread(target=_load_into_cache, args=(real, key, loading), name="tokenizer-load",
                             daemon=True).start()
    return loading.result()


def _load_into_cache(real: str, key: tuple[str, float, float], loading: Future[LoadedTokenizer]) -> None:
    """Load ``real`` into the cache on this thread, then build its text-only copy (``text_only_tokenizer``, seconds
    for a large vocabulary). The caller only waits: a render task whose time limit interrupts the wait (a cold
    load counts against it) leaves the load to finish, so the next request finds it ready."""
    try:
        loaded = load_tokenizer(real)
    except Exception as exc:  # noqa: BLE001 - handed to every waiter (their result() raises it)
        with _CACHE_LOCK:
            _LOADING.pop(key, None)
        loading.set_exception(exc)
        return
    with _CACHE_LOCK:
        for k in [k for k in _CACHE if k[0] == real]:
            del _CACHE[k]
        _CACHE[key] = loaded
        _LOADING.pop(key, None)
    loading.set_result(loaded)
    try:
        loaded.text_only_tokenizer()
    except Exception:  # built again (and its error raised) on first use
        logger.exception("text-only copy of %s", real)
    release_free_heap()


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` (``int malloc_trim(size_t pad)``), or None where the C library has none. Looked up in
    the process's own symbols (``dlopen(NULL)``: the C library it runs on), not with ``ctypes.util.find_library``,
    which runs ``/sbin/ldconfig -p`` in a child process at every import of this module."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _malloc_trim()


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the operating system (glibc ``malloc_trim(0)``); True when the C
    library has the call. A tokenizer load leaves most of its transient memory (the parse of a ``tokenizer.json``
    of up to ~33 MB, the text-only copy) free in the heap but resident: with the six reference tokenizers loaded,
    one call takes a process from ~700 to ~530 MB RSS, in ~25 ms (DECISIONS D-301). Called once per load, on the
    loading thread (never on a request's path)."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


def clear_tokenizer_cache() -> None:
    """Forget every cached tokenizer (tests, or an operator-triggered reload)."""
    with _CACHE_LOCK:
        _CACHE.clear()
