"""Model runner: the model, a bounded batch KV cache, batched forward passes; sampling is ``sampler.Sampler``'s.

Batch KV cache (``kv_cache.SlotKVCache``): one preallocated K/V row ("slot") per running sequence, its token
at position ``p`` in column ``p``; a sequence takes a slot when its prefill starts and gives it back when it
ends, so joining and leaving copy nothing. A decode step is one forward over slots ``0 .. rows-1`` with a 4-D
attention mask per row (each row sees its own columns up to its position). Prompts are prefilled whole (a
left-padded group from position 0, each row scattered into its slot) or a chunk at a time (``prefill_chunk``:
chunked prefill, a long prompt interleaved with the running decodes). Memory is bounded by
``max_num_seqs × max_model_len`` positions (``kv_cache.py``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any, cast

import torch

from .kv_cache import SlotKVCache
from .lm_head import CpuLMHead
from .prefix_cache import DEFAULT_PREFIX_CACHE_MB, ImageSpan, PrefixCache, block_hashes
from .sampler import LogprobEntry, Sampler
from .sequence import Sequence
from .structured import GrammarMask

log = logging.getLogger("inference.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# prompt positions per forward of a prompt-logprobs prefill: bounds its logits to CHUNK × vocab floats
# (256 × 151,680 × 4 B ≈ 155 MB for Qwen3's vocabulary)
PROMPT_LOGPROBS_CHUNK = 256


def _last_logits(out: Any) -> torch.Tensor:
    """float32 ``[B, vocab]`` logits of the last position of a causal LM's output (``logits`` ``[B, T, vocab]``)."""
    logits: torch.Tensor = out.logits
    return logits[:, -1, :].float()


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


def effective_max_model_len(requested: int | None, text_cfg: Any) -> int:
    """Positions per sequence (prompt + output) an engine serves: ``requested`` (the registry's ``max_model_len``),
    else the config's ``max_position_embeddings`` (4,096 when it has none).

    A ``requested`` length beyond ``max_position_embeddings`` is served as asked when the model's positions are rotary
    (its config has ``rope_theta``, ``rope_parameters`` or ``rope_scaling``): RoPE extends past the trained length,
    with a quality the operator chose by registering it (logged as a warning). This is vLLM's behaviour with
    ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``. The gateway checks prompt lengths against the registry's value, so an engine
    that served less would fail admitted prompts mid-stream. Raises ``ValueError`` for such a length on a model
    with learned absolute positions, which has no position past its table, and on dynamic RoPE, which transformers
    rescales for the whole batch once any position passes ``max_position_embeddings`` (vLLM's is static)."""
    limit = getattr(text_cfg, "max_position_embeddings", None)
    if requested is None:
        return int(limit or 4096)
    if limit is None or requested <= limit:
        return int(requested)
    if not any(getattr(text_cfg, name, None) is not None for name in ("rope_theta", "rope_parameters", "rope_scaling")):
        raise ValueError(f"max_model_len {requested} exceeds the model's max_position_embeddings {limit}, and its "
                         f"positions are not rotary: register it with max_model_len <= {limit}")
    if "dynamic" in _rope_types(text_cfg):
        raise ValueError(f"max_model_len {requested} exceeds the model's max_position_embeddings {limit}, and its "
                         "RoPE is dynamic (transformers rescales it for a whole batch once any position passes that "
                         f"length, changing the other sequences' outputs): register it with max_model_len <= {limit}")
    log.warning("max_model_len %d exceeds the model's max_position_embeddings %d: rotary positions past the trained "
                "length, as registered", requested, limit)
    return int(requested)


def _rope_types(text_cfg: Any) -> set[str]:
    """The RoPE types a config names (``rope_parameters``, flat or per layer type, or the older ``rope_scaling``)."""
    found: set[str] = set()
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(text_cfg, name, None)
        if not isinstance(params, dict):
            continue
        for part in [params, *(v for v in params.values() if isinstance(v, dict))]:
            kind = part.get("rope_type") or part.get("type")
            if isinstance(kind, str):
                found.add(kind)
    return found


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
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}")
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.model_dir = Path(model_dir)
        # subclasses load other heads (vision-language); the model class is chosen at run time and transformers'
        # model methods are loosely typed (``to`` is wrapped with functools.wraps, the head getters unannotated)
        loader: Any = auto_class or AutoModelForCausalLM
        config = AutoConfig.from_pretrained(model_dir)
        # the length before the weights: a registration the model cannot serve fails without loading them (a
        # supervisor restarting the replica would otherwise load them once per try)
        self.max_model_len = effective_max_model_len(max_model_len, config.get_text_config())
        self.model = loader.from_pretrained(model_dir, config=config, dtype=self.dtype).to(self.device).eval()
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
        self.sampler = Sampler(self.device, self.sample_vocab)
        text_cfg = cfg.get_text_config()  # the config itself for a plain causal LM
        try:
            gen = GenerationConfig.from_pretrained(model_dir)
            eos = gen.eos_token_id
        except OSError:
            eos = getattr(text_cfg, "eos_token_id", None)
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        layer_types = set(getattr(text_cfg, "layer_types", None) or ["full_attention"])
        if not layer_types <= {"full_attention", "sliding_attention"}:
            raise ValueError(f"unsupported attention layer types {sorted(layer_types)} (full and sliding only)")
        window = getattr(text_cfg, "sliding_window", None)
        self.sliding_window: int | None = (int(window) if window and ("sliding_attention" in layer_types or
                                                                      getattr(text_cfg, "use_sliding_window", False))
                                           else None)
        self.kv = SlotKVCache(self.max_model_len, self.device)  # the running batch's K/V
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
        """Sequences holding a slot of the KV cache."""
        return len(self.kv.used)

    def release(self, seqs: list[Sequence]) -> None:
        """Give the KV slots of ``seqs`` (finished, aborted, failed) back; nothing is copied."""
        for s in seqs:
            if s.slot is not None:
                self.kv.free(s.slot)
                s.slot = None

    def reset(self) -> None:
        """Free every KV slot (a failed step, tests)."""
        self.kv.reset()

    def _take_slot(self, seq: Sequence) -> int:
        if seq.slot is None:
            seq.slot = self.kv.alloc()
        return seq.slot

    def _mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor | None, causal: bool = False
              ) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """The 4-D attention mask ``[B, 1, q, T]`` (True = attend) of query positions ``q_pos`` ``[B, q]`` over key
        positions ``k_pos`` ``[B or 1, T]`` (``k_valid``: real keys, else all are): causal by position, and, for a
        model with sliding-window layers, a dict with the windowed mask for those layers (transformers takes a
        dict keyed by layer type as the masks it would have built).

        ``causal``: the forward is prompts from position 0 without padding, so the plain causal mask is right:
        None, for transformers to build (it lets SDPA take its ``is_causal`` kernel: measured 2× faster on a
        4,000-token prompt than with an explicit mask, 1 CPU thread)."""
        if causal and self.sliding_window is None:
            return None
        allowed = k_pos[:, None, None, :] <= q_pos[:, None, :, None]
        if k_valid is not None:
            allowed = allowed & k_valid[:, None, None, :]
        if self.sliding_window is None:
            return allowed
        near = k_pos[:, None, None, :] > q_pos[:, None, :, None] - self.sliding_window
        return {"full_attention": allowed, "sliding_attention": allowed & near}

    def _positions(self, pos: torch.Tensor) -> torch.Tensor:
        """The model's ``position_ids`` for decode positions ``pos`` ``[B, 1]`` (the VL runner adds M-RoPE)."""
        return pos

    def _long(self, values: list[int]) -> torch.Tensor:
        """A long tensor of ``values`` on the device (through pinned memory on CUDA, without a sync)."""
        t = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _forward_fresh(self, seqs: list[Sequence], ids: torch.Tensor, mask: torch.Tensor,
                       position_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """One left-padded forward of whole prompts from position 0 (``ids``/``mask`` ``[B, W]``), each row's K/V
        scattered into its own slot (taken here). Returns the model output (last position's logits)."""
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        slots = [self._take_slot(s) for s in seqs]
        rows, cols = mask.nonzero(as_tuple=True)
        slot_t = self._long(slots)
        self.kv.plan_fresh(slot_t[rows], pos[rows, cols], rows, cols, max(slots), ids.shape[1])
        return self.model(input_ids=ids, attention_mask=self._mask(pos, pos, mask.bool(), causal=bool(mask.all())),
                          position_ids=pos if position_ids is None else position_ids, cache=self.kv,
                          use_cache=True, logits_to_keep=1, **kwargs)

    def _forward_single(self, seq: Sequence, ids: list[int] | torch.Tensor, start: int,
                        position_ids: torch.Tensor | None = None, logits_to_keep: int = 1, **kwargs: Any) -> Any:
        """One forward of ``seq``'s tokens ``ids`` at positions ``start ..`` into its slot, attending over its own
        columns before them (a prompt chunk, or what follows a cached prefix)."""
        ids_t = ids if isinstance(ids, torch.Tensor) else self._long(list(ids))
        q = int(ids_t.numel())
        slot = self._take_slot(seq)
        self.kv.plan_single(slot, start, q)
        kpos = torch.arange(start + q, device=self.device).view(1, -1)
        qpos = kpos[:, start:]
        return self.model(input_ids=ids_t.view(1, q), attention_mask=self._mask(qpos, kpos, None, causal=start == 0),
                          position_ids=qpos if position_ids is None else position_ids, cache=self.kv,
                          use_cache=True, logits_to_keep=logits_to_keep, **kwargs)

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

    def _load_prefix(self, seq: Sequence) -> None:
        """Copy ``seq``'s cached prefix K/V (``num_cached_tokens`` positions) into its slot."""
        assert seq.prefix_entry is not None  # only sequences with a cached prefix (``prefill_groups``)
        self.kv.write(self._take_slot(seq), seq.prefix_entry.kv, seq.num_cached_tokens)
        seq.num_computed = seq.num_cached_tokens

    def _store_prefixes(self, seqs: list[Sequence]) -> None:
        """Offer each prefilled prompt's full blocks (from its slot) to the prefix cache."""
        for s in seqs:
            s.prefix_entry = None  # the slot holds its own copy now
        if self.prefix_cache is None:
            return
        for s in seqs:
            hashes = s.block_hashes
            if not hashes or self.prefix_cache.covers(hashes) or s.slot is None:
                continue
            self.prefix_cache.insert(hashes, self.kv.read(s.slot, len(hashes) * self.prefix_cache.block_size))

    # ------------------------------------------------------------------ forward passes
    # a runner whose prompts may be prefilled a chunk at a time (``prefill_chunk``); the VL runner's M-RoPE and
    # image embeddings need the whole prompt in one forward
    supports_chunked_prefill = True

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Prefill the whole prompts of ``seqs`` and give each a slot of the batch KV cache: one left-padded
        forward, or, for a single sequence with a cached prefix or asking for prompt logprobs
        (``prefill_groups``), ``prefill_chunk`` until its prompt is done.

        Returns the last-position logits, float32 ``[len(seqs), vocab]``, in ``seqs`` order. On an error the
        slots taken are given back and the error raised.
        """
        try:
            if len(seqs) == 1 and (seqs[0].params.prompt_logprobs is not None or seqs[0].prefix_entry is not None):
                seq = seqs[0]
                while (logits := self.prefill_chunk(seq, len(seq.request.prompt_token_ids))) is None:
                    pass
                return logits
            ids, mask = left_padded(seqs, self.device)
            out = self._forward_fresh(seqs, ids, mask)
        except BaseException:
            self.release(seqs)
            raise
        for s in seqs:
            s.num_computed = len(s.request.prompt_token_ids)
        self._store_prefixes(seqs)
        return _last_logits(out)

    @torch.inference_mode()
    def prefill_chunk(self, seq: Sequence, max_tokens: int) -> torch.Tensor | None:
        """Prefill the next at most ``max_tokens`` prompt tokens of ``seq`` (chunked prefill) into its slot, after
        its cached prefix if it has one (copied in on the first chunk). Returns the last prompt position's logits
        ``[1, vocab]`` once the whole prompt is in the cache, else None.

        A request for prompt logprobs (``SamplingParams.prompt_logprobs``) keeps every position's logits, so its
        chunks are at most ``PROMPT_LOGPROBS_CHUNK`` positions (its logits stay ``CHUNK × vocab`` floats) and
        ``seq.prompt_logprobs`` grows per chunk: ``None`` for the first prompt token, then per token
        ``[logprob, [[id, logprob], ...top k]]`` with k = ``prompt_logprobs`` (vLLM's prompt logprobs: position
        i's distribution scores token i + 1), from the distribution ``sample`` reports logprobs from (raw
        logits, ids the served tokenizer cannot decode masked out).
        """
        ids = seq.request.prompt_token_ids
        n = len(ids)
        if seq.num_computed == 0 and seq.prefix_entry is not None:
            self._load_prefix(seq)
        want_lp = seq.params.prompt_logprobs is not None
        if want_lp:
            max_tokens = min(max_tokens, PROMPT_LOGPROBS_CHUNK)
            if seq.num_computed == 0:
                seq.prompt_logprobs = [None]
        lo = seq.num_computed
        hi = min(n, lo + max(1, max_tokens))
        out = self._forward_single(seq, ids[lo:hi], lo, logits_to_keep=0 if want_lp else 1)
        seq.num_computed = hi
        if want_lp:
            logits = cast(torch.Tensor, out.logits)[0].float()  # [hi - lo, vocab]
            last = logits[-1:].clone()
            self._chunk_prompt_logprobs(seq, logits, lo, hi)
        else:
            last = _last_logits(out)
        if hi < n:
            return None
        self._store_prefixes([seq])
        return last

    def _chunk_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, lo: int, hi: int) -> None:
        """Append the prompt-logprob entries of prompt positions ``lo .. hi-1`` (their logits ``[hi - lo, vocab]``,
        modified here) to ``seq.prompt_logprobs``."""
        ids = seq.request.prompt_token_ids
        n, k = len(ids), seq.params.prompt_logprobs or 0
        limit = min(self.sample_vocab, seq.params.vocab_size or self.sample_vocab)
        rows = min(hi, n - 1) - lo  # the last prompt position predicts no prompt token
        if rows <= 0:
            return
        if limit < logits.shape[1]:
            logits[:rows, limit:] = float("-inf")
        lp = torch.log_softmax(logits[:rows], dim=-1)
        target = self._long(ids[lo + 1:lo + 1 + rows])
        chosen = lp.gather(1, target.unsqueeze(1)).squeeze(1).tolist()
        tv: list[list[float]] = []
        ti: list[list[int]] = []
        if k:
            top_v, top_i = torch.topk(lp, min(k, lp.shape[1]), dim=-1)
            tv, ti = top_v.tolist(), top_i.tolist()
        entries = seq.prompt_logprobs if seq.prompt_logprobs is not None else [None]
        for r in range(rows):
            entries.append([chosen[r], [[ti[r][j], tv[r][j]] for j in range(len(ti[r]))] if k else []])
        seq.prompt_logprobs = entries

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One decode step for ``seqs`` (each holds a slot and has its prompt in the cache): each feeds its newest
        output token at position ``num_computed``. The forward's rows are slots ``0 .. rows-1``; a slot not in
        ``seqs`` (free, or a prompt still being prefilled in chunks) rides along as a row that writes nothing.

        Returns float32 logits ``[len(seqs), vocab]`` in ``seqs`` order.
        """
        rows = self.kv.rows
        tokens = [0] * rows
        cols = [0] * rows
        deltas = [0] * rows
        slots: list[int] = []
        for s in seqs:
            assert s.slot is not None  # decoding sequences hold a slot
            tokens[s.slot], cols[s.slot], deltas[s.slot] = s.output_token_ids[-1], s.num_computed, s.rope_delta
            slots.append(s.slot)
        kv_len = max(cols) + 1
        tok_t, col_t = self._long(tokens).view(rows, 1), self._long(cols).view(rows, 1)
        slot_t = self._long(slots)
        self.kv.plan_rows(rows, kv_len, slot_t, col_t[slot_t, 0], slot_t)
        kpos = torch.arange(kv_len, device=self.device).view(1, -1)
        pos = col_t + self._long(deltas).view(rows, 1) if any(deltas) else col_t
        out = self.model(input_ids=tok_t, attention_mask=self._mask(col_t, kpos, None),
                         position_ids=self._positions(pos), cache=self.kv, use_cache=True, logits_to_keep=1)
        logits = _last_logits(out)
        if slots == list(range(rows)):
            return logits
        return logits.index_select(0, slot_t)

    # ------------------------------------------------------------------ sampling
    def sample(self, logits: torch.Tensor, seqs: list[Sequence], grammar: GrammarMask | None = None
               ) -> tuple[list[int], list[LogprobEntry | None] | None]:
        """One token per row of ``logits`` ``[B, vocab]`` for ``seqs`` (same order), with their logprob entries
        when asked: ``sampler.Sampler.sample`` over the ids the served tokenizer decodes."""
        return self.sampler.sample(logits, seqs, grammar)


def make_rng(seed: int | None) -> random.Random:
    """Per-request random source: seeded when ``seed`` is given, else from the OS."""
    return random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))


def now() -> float:
    """Unix time in seconds (wire timestamps)."""
    return time.time()
