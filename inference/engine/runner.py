"""Model runner: the model, a bounded batch KV cache, batched forward passes and batched sampling.

torch and transformers are imported here (and only under ``inference/engine/``).

Batch KV layout ("right-aligned rows"): the running batch keeps one transformers ``DynamicCache``
whose layers hold keys/values of shape ``[B, kv_heads, T, head_dim]`` plus a padding mask ``[B, T]``.
Every row's newest token sits in the last column, so one decode step appends one column for the whole
batch. A new group of requests is prefilled on its own (left-padded, one forward) and then merged
into the batch by padding the shorter side on the left; finished rows are removed with
``index_select`` and all-padding leading columns are trimmed. Hence ``T`` equals the longest live
sequence and the cache is bounded by ``max_num_seqs × max_model_len`` positions; requests join and
leave between any two steps.

Sampling is batched over rows (greedy ``argmax`` for temperature 0; one inverse-CDF draw per row
otherwise) with per-request randomness from a ``random.Random(seed)`` owned by the request, so a
seeded request's tokens do not depend on its batch companions (up to float rounding of the logits).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from inference.protocol.engine import EngineCoreRequest, SamplingParams

from .prefix_cache import DEFAULT_PREFIX_CACHE_MB, ImageSpan, PrefixCache, PrefixEntry, block_hashes
from .structured import GrammarMask, SequenceGrammar

if TYPE_CHECKING:
    from transformers import DynamicCache

log = logging.getLogger("inference.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# prompt positions per forward of a prompt-logprobs prefill: bounds its logits to CHUNK × vocab floats
# (256 × 151,680 × 4 B ≈ 155 MB for Qwen3's vocabulary)
PROMPT_LOGPROBS_CHUNK = 256


class _KVLayer(Protocol):
    """A layer of a ``DynamicCache`` once filled: ``keys``/``values`` ``[B, kv_heads, T, head_dim]`` (transformers
    types them ``Tensor | None``, None only before the first update)."""

    keys: torch.Tensor
    values: torch.Tensor


def _kv_layers(cache: DynamicCache) -> list[_KVLayer]:
    """``cache``'s layers, filled (every cache here has been through a forward)."""
    return cast("list[_KVLayer]", cache.layers)


def _last_logits(out: Any) -> torch.Tensor:
    """float32 ``[B, vocab]`` logits of the last position of a causal LM's output (``logits`` ``[B, T, vocab]``)."""
    logits: torch.Tensor = out.logits
    return logits[:, -1, :].float()


_LARGE_LOGIT = 1e30  # stands in for +inf after the penalties: finite even divided by the smallest temperature


class RequestError(ValueError):
    """A request that cannot run (bad token id, too long, bad parameter); fails only that request."""


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    """Raise ``RequestError`` when ``ids`` is empty or holds a non-int or an id outside ``[0, vocab_size)``."""
    if not ids:
        raise RequestError("prompt_token_ids is empty")
    bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]!r} out of range [0, {vocab_size})")


def left_padded(seqs: list[Sequence], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts of ``seqs`` left-padded to the longest: ``(input_ids, attention_mask)``, both long
    ``[len(seqs), max prompt length]`` on ``device`` (pad id 0, mask 0 on the padding)."""
    lens = [len(s.request.prompt_token_ids) for s in seqs]
    width = max(lens)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - lens[i]:] = torch.tensor(s.request.prompt_token_ids, dtype=torch.long)
        mask[i, width - lens[i]:] = 1
    return ids.to(device), mask.to(device)


@dataclass
class Sequence:
    """Engine-side state of one request.

    ``output_token_ids`` grows by one per step; ``num_computed`` is how many tokens are in the KV
    cache (prompt + outputs except the newest one, which is the next step's input).
    """

    request: EngineCoreRequest
    queued_ts: float
    rng: random.Random
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    scheduled_ts: float | None = None
    first_token_ts: float | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    bias_ids: torch.Tensor | None = None
    bias_vals: torch.Tensor | None = None
    prompt_ids_t: torch.Tensor | None = None
    # prefix caching (prefix_cache.py): the prompt's block hashes, and the cached prefix its prefill reuses
    block_hashes: list[bytes] | None = None
    prefix_entry: PrefixEntry | None = None
    num_cached_tokens: int = 0
    # ``prompt_logprobs`` entries computed at prefill (``SamplingParams.prompt_logprobs``), sent with the first token
    prompt_logprobs: list[Any] | None = None
    # ``stop_token_ids`` / ``eos_token_ids`` as sets, built once: the stop check is a lookup per step
    stop_ids: frozenset[int] = frozenset()
    eos_ids: frozenset[int] = frozenset()
    # structured outputs (``structured.py``): the request's grammar state, None when unconstrained
    grammar: SequenceGrammar | None = None

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.request.sampling_params.stop_token_ids)
        self.eos_ids = frozenset(self.request.sampling_params.eos_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling_params


def _tokenizer_vocab_size(model_dir: Path) -> int | None:
    """Ids the model directory's tokenizer can emit (max id + 1), or None without tokenizer.json."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        ids = list((data.get("model") or {}).get("vocab", {}).values())
        ids += [t["id"] for t in data.get("added_tokens", [])]
        return max(ids) + 1 if ids else None
    except (ValueError, KeyError, TypeError, OSError):
        return None


class CpuLMHead(torch.nn.Module):
    """The output projection ``x @ W.T`` computed as ``(W @ x.T).T`` on the CPU.

    With the vocabulary as the long side (``W``: ``[vocab, hidden]``, e.g. 151,680 × 128) and few rows (a decode
    step), ``nn.functional.linear`` takes a slow path on torch 2.13's CPU build: measured on the 2-core box,
    10.6 ms for 1 row, 32 ms for 3, 18 ms for 16; ``torch.mm(W, x.T)`` takes 2.5 ms for 2 rows, 3.4 ms for 3,
    9-10 ms for 16 (a single row is padded to two: the 1-row GEMV path is the slow one again). Same weight
    object, so tied embeddings stay tied; same numbers up to float rounding.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., hidden]`` → logits ``[..., vocab]`` (contiguous)."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        if rows == 1:
            flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
        out = torch.mm(self.weight, flat.t()).t()[:rows].contiguous()
        return out.reshape(*lead, out.shape[-1])


class ModelRunner:
    """Loads an HF-format causal LM directory and runs prefill/decode steps on a batch of Sequences.

    Args:
        model_dir: Hugging Face-format directory (config.json + weights).
        device: ``cpu`` or ``cuda`` (or ``cuda:N``).
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        max_model_len: prompt + output positions per sequence; defaults to the config's
            ``max_position_embeddings``.
        prefix_cache_mb: bytes (MiB) of prompt K/V kept for reuse by later prompts with the same prefix
            (``prefix_cache.py``); 0 disables it. Models with sliding-window or other non-full attention layers
            never use it.
    Raises ``ValueError`` for an unknown dtype, and whatever transformers raises for a bad directory.
    """

    def __init__(self, model_dir: str, device: str = "cpu", dtype: str = "float32",
                 max_model_len: int | None = None, auto_class: type[Any] | None = None,
                 prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB):
        from transformers import AutoModelForCausalLM, GenerationConfig

        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}")
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.model_dir = Path(model_dir)
        # subclasses load other heads (vision-language); the model class is chosen at run time and transformers'
        # model methods are loosely typed (``to`` is wrapped with functools.wraps, the head getters unannotated)
        loader: Any = auto_class or AutoModelForCausalLM
        self.model = loader.from_pretrained(model_dir, dtype=self.dtype).to(self.device).eval()
        head = self.model.get_output_embeddings()
        # torch types ``Linear.bias`` as a Tensor; it is None for a Linear built with bias=False
        if self.device.type == "cpu" and type(head) is torch.nn.Linear and cast(object, head.bias) is None:
            self.model.set_output_embeddings(CpuLMHead(head.weight))
        cfg = self.model.config
        self.config = cfg
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        # Ids beyond the tokenizer's vocabulary (embedding padding) can never be detokenized: mask them.
        tok_vocab = _tokenizer_vocab_size(self.model_dir)
        self.sample_vocab = min(self.vocab_size, tok_vocab) if tok_vocab else self.vocab_size
        text_cfg = cfg.get_text_config()  # the config itself for a plain causal LM
        limit = getattr(text_cfg, "max_position_embeddings", None) or 4096
        self.max_model_len = min(max_model_len or limit, limit)
        try:
            gen = GenerationConfig.from_pretrained(model_dir)
            eos = gen.eos_token_id
        except OSError:
            eos = getattr(text_cfg, "eos_token_id", None)
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.cache: DynamicCache | None = None  # the running batch's K/V
        self.mask: torch.Tensor | None = None  # [B, T] long, 1 = real token
        layer_types = set(getattr(text_cfg, "layer_types", None) or ["full_attention"])
        full_attention = layer_types == {"full_attention"} and not getattr(text_cfg, "use_sliding_window", False)
        self.prefix_cache = (PrefixCache(int(prefix_cache_mb * 2**20))
                             if prefix_cache_mb > 0 and full_attention else None)

    # ------------------------------------------------------------------ validation
    def prepare(self, seq: Sequence) -> None:
        """Validate a request and precompute its per-request tensors.

        Raises ``RequestError`` with a client-facing message when the request cannot run.
        """
        req = seq.request
        ids = req.prompt_token_ids
        sp = req.sampling_params
        check_token_ids(ids, self.vocab_size)
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} (prompt + output)")
        if sp.max_tokens < 1:
            raise RequestError("max_tokens must be >= 1")
        if sp.temperature < 0 or not math.isfinite(sp.temperature):
            raise RequestError("temperature must be >= 0")
        if not 0 < sp.top_p <= 1:
            raise RequestError("top_p must be in (0, 1]")
        if not 0 <= sp.min_p <= 1:
            raise RequestError("min_p must be in [0, 1]")
        if sp.repetition_penalty <= 0:
            raise RequestError("repetition_penalty must be > 0")
        if sp.logprobs is not None and sp.logprobs < 0:
            raise RequestError("logprobs must be >= 0")
        if sp.prompt_logprobs is not None and sp.prompt_logprobs < 0:
            raise RequestError("prompt_logprobs must be >= 0")
        if sp.logit_bias:
            keys = list(sp.logit_bias)
            if any(k < 0 or k >= self.vocab_size for k in keys):
                raise RequestError("logit_bias token id out of range")
            seq.bias_ids = torch.tensor(keys, dtype=torch.long, device=self.device)
            seq.bias_vals = torch.tensor([float(sp.logit_bias[k]) for k in keys],
                                         dtype=torch.float32, device=self.device)
        if sp.repetition_penalty != 1.0:
            seq.prompt_ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ batch cache
    @property
    def batch_size(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[0])

    def _layers(self) -> list[_KVLayer]:
        assert self.cache is not None  # called only while a batch is held (``mask`` set)
        return _kv_layers(self.cache)

    def remove_rows(self, keep: list[int]) -> None:
        """Keep only batch rows ``keep`` (in that order) and trim all-padding leading columns."""
        if self.mask is None:
            return
        if not keep:
            self.cache = None
            self.mask = None
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self.mask.index_select(0, idx)
        start = int(mask.any(0).to(torch.int8).argmax().item())
        self.mask = mask[:, start:]
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, idx)[:, :, start:]
            layer.values = layer.values.index_select(0, idx)[:, :, start:]

    def _merge(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        """Append a prefilled group (its own cache and mask) below the running batch."""
        if self.mask is None:
            self.cache, self.mask = cache, mask
            return
        t_old, t_new = self.mask.shape[1], mask.shape[1]
        width = max(t_old, t_new)

        def lpad(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
            if n == 0:
                return x
            shape = list(x.shape)
            shape[dim] = n
            return torch.cat([x.new_zeros(shape), x], dim=dim)

        self.mask = torch.cat([lpad(self.mask, 1, width - t_old), lpad(mask, 1, width - t_new)], 0)
        for old, new in zip(self._layers(), _kv_layers(cache)):
            old.keys = torch.cat([lpad(old.keys, 2, width - t_old), lpad(new.keys, 2, width - t_new)], 0)
            old.values = torch.cat([lpad(old.values, 2, width - t_old), lpad(new.values, 2, width - t_new)], 0)

    # ------------------------------------------------------------------ prefix caching
    def image_spans(self, seq: Sequence) -> list[ImageSpan]:
        """Placeholder spans of ``seq``'s images (none for a text-only model; the VL runner overrides)."""
        return []

    def prefill_groups(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        """Split a prefill group: the prompts without a usable cached prefix (one batched forward), then each
        prompt with one on its own (its forward starts after the prefix). Sets ``block_hashes``,
        ``prefix_entry`` and ``num_cached_tokens`` on every sequence.

        The prefix reused is the longest cached one, cut to leave at least the last prompt token to compute
        (its logits give the first output token); it may end inside an image's placeholders (the VL runner then
        feeds the rest of that image's embeddings).

        A request for prompt logprobs (``SamplingParams.prompt_logprobs``) needs every prompt position's logits:
        it always runs on its own group, never from a cached prefix (its blocks are still offered to the cache).
        """
        own = [[s] for s in seqs if s.params.prompt_logprobs is not None]
        if own:
            seqs = [s for s in seqs if s.params.prompt_logprobs is None]
        if self.prefix_cache is None:
            return ([seqs] if seqs else []) + own
        for (s,) in own:
            s.block_hashes = block_hashes(s.request.prompt_token_ids, self.image_spans(s),
                                          self.prefix_cache.block_size, s.request.cache_salt)
        plain: list[Sequence] = []
        hits: list[list[Sequence]] = []
        for s in seqs:
            ids = s.request.prompt_token_ids
            spans = self.image_spans(s)
            s.block_hashes = block_hashes(ids, spans, self.prefix_cache.block_size, s.request.cache_salt)
            entry, n = self.prefix_cache.lookup(s.block_hashes)
            n = min(n, len(ids) - 1)
            s.prefix_entry, s.num_cached_tokens = (entry, n) if entry is not None and n > 0 else (None, 0)
            if s.prefix_entry is not None:
                hits.append([s])
            else:
                plain.append(s)
        return ([plain] if plain else []) + hits + own

    def _prefix_cache_of(self, seq: Sequence) -> DynamicCache:
        """A fresh ``DynamicCache`` holding ``seq``'s cached prefix K/V (batch of one)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        n = seq.num_cached_tokens
        assert seq.prefix_entry is not None  # only sequences with a cached prefix (``prefill_groups``)
        for i, (k, v) in enumerate(seq.prefix_entry.kv):
            cache.update(k[None, :, :n].to(self.device), v[None, :, :n].to(self.device), i)
        return cache

    def _store_prefixes(self, seqs: list[Sequence], cache: DynamicCache, width: int) -> None:
        """Offer each prefilled prompt's full blocks to the prefix cache (rows right-aligned at ``width``)."""
        if self.prefix_cache is None:
            return
        for i, s in enumerate(seqs):
            hashes = s.block_hashes
            if not hashes or self.prefix_cache.covers(hashes):
                continue
            lo = width - len(s.request.prompt_token_ids)
            self.prefix_cache.insert(hashes, [(layer.keys[i, :, lo:], layer.values[i, :, lo:])
                                              for layer in _kv_layers(cache)])
        for s in seqs:
            s.prefix_entry = None  # the batch holds its own copy now

    # ------------------------------------------------------------------ forward passes
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Run the prompts of ``seqs`` and append them to the batch: one left-padded forward, or, for a single
        sequence with a cached prefix (``prefill_groups``), a forward of the tokens after it.

        Returns the last-position logits, float32 ``[len(seqs), vocab]``. The new rows follow the
        existing ones, in ``seqs`` order. A single sequence that asks for prompt logprobs runs through
        ``_prefill_prompt_logprobs``.
        """
        from transformers import DynamicCache

        if len(seqs) == 1 and seqs[0].params.prompt_logprobs is not None:
            return self._prefill_prompt_logprobs(seqs[0])
        if len(seqs) == 1 and seqs[0].prefix_entry is not None:
            return self._prefill_cached(seqs[0])
        ids, mask = left_padded(seqs, self.device)
        width = ids.shape[1]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                         use_cache=True, logits_to_keep=1)
        for s in seqs:
            s.num_computed = len(s.request.prompt_token_ids)
        self._store_prefixes(seqs, cache, width)
        self._merge(cache, mask)
        return _last_logits(out)

    def _prefill_cached(self, seq: Sequence) -> torch.Tensor:
        """Prefill one sequence whose first ``num_cached_tokens`` positions come from the prefix cache."""
        ids = seq.request.prompt_token_ids
        n, p = len(ids), seq.num_cached_tokens
        cache = self._prefix_cache_of(seq)
        suffix = torch.tensor([ids[p:]], dtype=torch.long, device=self.device)
        mask = torch.ones((1, n), dtype=torch.long, device=self.device)
        pos = torch.arange(p, n, dtype=torch.long, device=self.device).view(1, -1)
        out = self.model(input_ids=suffix, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                         logits_to_keep=1)
        seq.num_computed = n
        self._store_prefixes([seq], cache, n)
        self._merge(cache, mask)
        return _last_logits(out)

    def _prefill_prompt_logprobs(self, seq: Sequence) -> torch.Tensor:
        """Prefill one sequence from position 0 in chunks of ``PROMPT_LOGPROBS_CHUNK`` positions, keeping every
        position's logits, and set ``seq.prompt_logprobs``: ``None`` for the first prompt token, then per token
        ``[logprob, [[id, logprob], ...top k]]`` with k = ``prompt_logprobs`` (vLLM's prompt logprobs: position
        i's distribution scores token i + 1). The distribution is the one ``sample`` reports logprobs from: raw
        logits with the ids the served tokenizer cannot decode masked out. Returns the last position's logits
        ``[1, vocab]``; the sequence joins the batch as ``prefill`` would add it."""
        from transformers import DynamicCache

        ids = seq.request.prompt_token_ids
        n, k = len(ids), seq.params.prompt_logprobs or 0
        limit = min(self.sample_vocab, seq.params.vocab_size or self.sample_vocab)
        cache = DynamicCache(config=self.config)
        entries: list[Any] = [None]
        last = torch.empty(0)
        for lo in range(0, n, PROMPT_LOGPROBS_CHUNK):
            hi = min(n, lo + PROMPT_LOGPROBS_CHUNK)
            out = self.model(input_ids=torch.tensor([ids[lo:hi]], dtype=torch.long, device=self.device),
                             attention_mask=torch.ones((1, hi), dtype=torch.long, device=self.device),
                             position_ids=torch.arange(lo, hi, dtype=torch.long, device=self.device).view(1, -1),
                             cache=cache, use_cache=True, logits_to_keep=0)
            logits = cast(torch.Tensor, out.logits)[0].float()  # [hi - lo, vocab]
            last = logits[-1:].clone()
            rows = min(hi, n - 1) - lo  # the last prompt position predicts no prompt token
            if rows <= 0:
                continue
            if limit < logits.shape[1]:
                logits[:rows, limit:] = float("-inf")
            lp = torch.log_softmax(logits[:rows], dim=-1)
            target = torch.tensor(ids[lo + 1:lo + 1 + rows], dtype=torch.long, device=self.device)
            chosen = lp.gather(1, target.unsqueeze(1)).squeeze(1).tolist()
            if k:
                top_v, top_i = torch.topk(lp, min(k, lp.shape[1]), dim=-1)
                tv, ti = top_v.tolist(), top_i.tolist()
            for r in range(rows):
                entries.append([chosen[r], [[ti[r][j], tv[r][j]] for j in range(len(ti[r]))] if k else []])
        seq.prompt_logprobs = entries
        seq.num_computed = n
        self._store_prefixes([seq], cache, n)
        self._merge(cache, torch.ones((1, n), dtype=torch.long, device=self.device))
        return last

    @torch.inference_mode()
    def decode(self, last_tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step for every batch row: row i feeds ``last_tokens[i]`` at ``positions[i]``.

        Returns float32 logits ``[B, vocab]``.
        """
        b = self.batch_size
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device).view(b, 1)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device).view(b, 1)
        assert self.mask is not None  # a decode step runs on a held batch
        self.mask = torch.cat([self.mask, self.mask.new_ones((b, 1))], 1)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=pos, cache=self.cache,
                         use_cache=True, logits_to_keep=1)
        return _last_logits(out)

    # ------------------------------------------------------------------ sampling
    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence], grammar: GrammarMask | None = None
               ) -> tuple[list[int], list[list[Any] | None] | None]:
        """Pick one token per row of ``logits`` ``[B, vocab]`` for ``seqs`` (same order).

        Applies, as vLLM does: the structured-output mask of ``grammar`` (its rows' disallowed tokens to -inf),
        logit_bias, min_tokens (EOS/stop masked; not on a row the grammar constrains: the grammar decides where
        its output ends), repetition / presence / frequency penalties, temperature (0 = greedy), top_k, top_p,
        min_p. A -inf logit stays -inf under every later step, so the mask may come first. Logprobs (when asked)
        come from the model's distribution after the grammar mask and before anything else (vLLM's default
        ``raw_logprobs``; vLLM applies the grammar bitmask to the logits before its sampler).
        Returns (token ids, per-row logprob entries or None) where an entry is
        ``[sampled_logprob, [[id, logprob], ...top-k]]`` or None for rows that did not ask.
        """
        b, v = logits.shape
        if self.sample_vocab < v:
            logits[:, self.sample_vocab:] = float("-inf")
        for i, s in enumerate(seqs):  # the served tokenizer may decode fewer ids than the model has
            limit = s.params.vocab_size
            if 0 < limit < min(v, self.sample_vocab):
                logits[i, limit:] = float("-inf")
        if grammar is not None:
            grammar.apply(logits)
        constrained = set(grammar.row_list) if grammar is not None else set()
        want_lp = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        raw_lp = torch.log_softmax(logits[want_lp], dim=-1) if want_lp else None

        for i, s in enumerate(seqs):
            sp = s.params
            row = logits[i]
            if s.bias_ids is not None and s.bias_vals is not None:  # set together (``prepare``)
                row.index_add_(0, s.bias_ids, s.bias_vals)
            if len(s.output_token_ids) < sp.min_tokens and i not in constrained:
                blocked = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(sp.eos_token_ids))
                blocked = [t for t in blocked if 0 <= t < v]
                if blocked:
                    row[blocked] = float("-inf")
            if sp.repetition_penalty != 1.0:
                seen = s.prompt_ids_t
                assert seen is not None  # set by ``prepare`` when repetition_penalty != 1
                if s.output_token_ids:
                    seen = torch.cat([seen, torch.tensor(s.output_token_ids, device=self.device)])
                seen = torch.unique(seen)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
            if (sp.presence_penalty or sp.frequency_penalty) and s.output_token_ids:
                out_ids = torch.tensor(s.output_token_ids, device=self.device)
                uniq, counts = torch.unique(out_ids, return_counts=True)
                row[uniq] -= sp.frequency_penalty * counts.to(row.dtype) + sp.presence_penalty
        # a penalty at the edge of its range (repetition_penalty 5e-324 is 0 in float32: x / 0 = inf) must not
        # turn the row into NaN probabilities, whose inverse-CDF pick is past the vocabulary: +inf becomes a large
        # finite logit (those tokens share the mass), NaN a disallowed one
        torch.nan_to_num_(logits, nan=float("-inf"), posinf=_LARGE_LOGIT)

        temps = [s.params.temperature for s in seqs]
        chosen = torch.argmax(logits, dim=-1)
        sampled_rows = [i for i, t in enumerate(temps) if t > 0]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=self.device)
            x = logits[rows] / torch.tensor([temps[i] for i in sampled_rows], device=self.device).unsqueeze(1)
            sub = [seqs[i].params for i in sampled_rows]
            ks = [p.top_k if p.top_k and p.top_k > 0 else 0 for p in sub]
            if any(ks):
                kmax = min(max(ks), v)
                top = torch.topk(x, kmax, dim=-1).values
                kk = torch.tensor([min(k, v) if k else kmax for k in ks], device=self.device) - 1
                kth = top.gather(1, kk.unsqueeze(1))
                limited = torch.tensor([bool(k) for k in ks], device=self.device).unsqueeze(1)
                x = torch.where(limited & (x < kth), torch.full_like(x, float("-inf")), x)
            probs = torch.softmax(x, dim=-1)
            ps = [p.top_p for p in sub]
            if any(p < 1.0 for p in ps):
                sp_, si = torch.sort(probs, dim=-1, descending=True)
                csum = torch.cumsum(sp_, dim=-1)
                top_p = torch.tensor(ps, device=self.device, dtype=probs.dtype).unsqueeze(1)
                drop = (csum - sp_) >= top_p  # keep the smallest prefix whose mass reaches top_p
                sp_ = sp_.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter_(1, si, sp_)
            mps = [p.min_p for p in sub]
            if any(m > 0 for m in mps):
                thr = probs.max(dim=-1, keepdim=True).values * torch.tensor(
                    mps, device=self.device, dtype=probs.dtype).unsqueeze(1)
                probs = probs.masked_fill(probs < thr, 0.0)
            cdf = torch.cumsum(probs, dim=-1)
            u = torch.tensor([seqs[i].rng.random() for i in sampled_rows], device=self.device,
                             dtype=cdf.dtype).unsqueeze(1)
            pick = torch.searchsorted(cdf, (u * cdf[:, -1:]).contiguous(), right=True).squeeze(1)
            pick = pick.clamp(max=v - 1)
            chosen[rows] = pick
        tokens = chosen.tolist()

        entries: list[list[Any] | None] | None = None
        if want_lp:
            entries = [None] * b
            kmax = max(seqs[i].params.logprobs or 0 for i in want_lp)  # not None: rows in want_lp asked
            tok_t = torch.tensor([tokens[i] for i in want_lp], device=self.device)
            assert raw_lp is not None  # computed when want_lp
            sampled = raw_lp.gather(1, tok_t.unsqueeze(1)).squeeze(1).tolist()
            if kmax > 0:
                top_v, top_i = torch.topk(raw_lp, kmax, dim=-1)
                tv, ti = top_v.tolist(), top_i.tolist()
            for j, i in enumerate(want_lp):
                k = seqs[i].params.logprobs
                top_lps = [[ti[j][n], tv[j][n]] for n in range(k)] if k else []
                entries[i] = [sampled[j], top_lps]
        return tokens, entries


def make_rng(seed: int | None) -> random.Random:
    """Per-request random source: seeded when ``seed`` is given, else from the OS."""
    return random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))


def now() -> float:
    """Unix time in seconds (wire timestamps)."""
    return time.time()
