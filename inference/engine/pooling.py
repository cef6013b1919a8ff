"""Pooling mode of the engine worker: embedding models (``python -m inference.engine --task embed ...``).

A pooling replica reads the same request stream as a generation replica (docs/ARCHITECTURE.md §6) and answers every
``EngineCoreRequest`` (``pooling=True``) with exactly one ``EngineCoreOutput`` that carries the pooled
vector (``pooled``: float32 little-endian bytes) and ``finish_reason="stop"``. Concurrent requests (the
inputs of one ``/v1/embeddings`` call, and those of concurrent calls) are batched: each step takes up to
``max_num_seqs`` waiting requests whose padded size fits ``max_num_batched_tokens`` and runs one forward.

The pooling recipe comes from the model directory, the way sentence-transformers stores it:

* ``modules.json`` lists the modules; a ``sentence_transformers.models.Normalize`` module means L2
  normalisation of the pooled vector;
* ``<pooling dir>/config.json`` (``1_Pooling/config.json``) selects ``pooling_mode_mean_tokens`` (mean
  over the attention mask), ``pooling_mode_cls_token``, ``pooling_mode_max_tokens`` or
  ``pooling_mode_lasttoken``;
* ``sentence_bert_config.json``'s ``max_seq_length`` bounds the input length (default for
  ``max_model_len``).

Without those files: mean pooling and normalisation (vLLM's defaults for ``embed``).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from collections.abc import Iterator
from typing import TypedDict

import torch

from inference.protocol.engine import FINISH_ERROR, FINISH_STOP, EngineCoreOutput, EngineStats

from .base_scheduler import BaseScheduler, Outputs, ema
from .runner import DTYPES, RequestError, check_token_ids, now
from .sequence import Sequence

log = logging.getLogger("inference.engine")

POOLING_MODES = ("mean", "cls", "max", "lasttoken")


class PoolingRecipe(TypedDict):
    """How a sentence-transformers directory pools: ``mode`` one of ``POOLING_MODES``, L2 ``normalize``, and its
    ``max_seq_length`` in tokens (None: no bound of its own)."""

    mode: str
    normalize: bool
    max_seq_length: int | None


def pooling_recipe(model_dir: str | Path) -> PoolingRecipe:
    """``{"mode": "mean"|"cls"|"max"|"lasttoken", "normalize": bool, "max_seq_length": int|None}`` read
    from a sentence-transformers model directory (defaults: mean, normalised, no length bound)."""
    d = Path(model_dir)
    recipe: PoolingRecipe = {"mode": "mean", "normalize": True, "max_seq_length": None}
    modules_path = d / "modules.json"
    if modules_path.is_file():
        modules = json.loads(modules_path.read_text())
        recipe["normalize"] = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
        for m in modules:
            if str(m.get("type", "")).endswith("Pooling"):
                cfg_path = d / m.get("path", "") / "config.json"
                if cfg_path.is_file():
                    cfg = json.loads(cfg_path.read_text())
                    for mode in POOLING_MODES:
                        key = "pooling_mode_mean_tokens" if mode == "mean" else (
                            "pooling_mode_cls_token" if mode == "cls" else f"pooling_mode_{mode}_tokens"
                            if mode == "max" else "pooling_mode_lasttoken")
                        if cfg.get(key):
                            recipe["mode"] = mode
                            break
    sbert = d / "sentence_bert_config.json"
    if sbert.is_file():
        msl = json.loads(sbert.read_text()).get("max_seq_length")
        recipe["max_seq_length"] = int(msl) if msl else None
    return recipe


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    """Pool ``hidden`` ``[B, T, H]`` over the real tokens of ``mask`` ``[B, T]`` (1 = token, right padding)
    into float32 ``[B, H]``; L2-normalise when ``normalize`` (sentence-transformers' ``Normalize``)."""
    hidden = hidden.float()
    m = mask.to(hidden.dtype).unsqueeze(-1)
    if mode == "mean":
        out = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    elif mode == "cls":
        out = hidden[:, 0]
    elif mode == "max":
        out = hidden.masked_fill(m == 0, float("-inf")).max(1).values
    elif mode == "lasttoken":
        last = mask.long().sum(1) - 1
        out = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    else:
        raise ValueError(f"unknown pooling mode {mode!r}")
    if normalize:
        out = torch.nn.functional.normalize(out, p=2, dim=-1)
    return out


class PoolingRunner:
    """Loads an HF-format encoder (``AutoModel``) and pools its last hidden states.

    Args:
        model_dir: Hugging Face-format directory (config.json + weights, sentence-transformers files
            optional, see the module docstring).
        device: ``cpu`` or ``cuda[:N]``; dtype: ``float32``/``bfloat16``/``float16``.
        max_model_len: longest input in tokens; default ``max_seq_length`` of the directory, else the
            config's ``max_position_embeddings``; never above the latter.
    Attributes the engine reads: ``device``, ``max_model_len``, ``vocab_size``, ``dim`` (pooled size).
    """

    def __init__(self, model_dir: str, device: str = "cpu", dtype: str = "float32",
                 max_model_len: int | None = None):
        from transformers import AutoModel

        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}")
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.model_dir = Path(model_dir)
        self.model = AutoModel.from_pretrained(model_dir, dtype=self.dtype).to(self.device).eval()
        cfg = self.model.config
        self.config = cfg
        self.recipe = pooling_recipe(model_dir)
        limit = getattr(cfg, "max_position_embeddings", None) or 512
        self.max_model_len = min(max_model_len or self.recipe["max_seq_length"] or limit, limit)
        self.vocab_size = int(cfg.vocab_size)
        self.dim = int(cfg.hidden_size)
        self.pad_id = int(getattr(cfg, "pad_token_id", None) or 0)

    def prepare(self, seq: Sequence) -> None:
        """Validate one request; raises ``RequestError`` (empty, id out of range, longer than
        ``max_model_len``, or not a pooling request)."""
        req = seq.request
        if not req.pooling:
            raise RequestError("this engine serves an embedding model (pooling mode); it cannot generate")
        ids = req.prompt_token_ids
        check_token_ids(ids, self.vocab_size)
        if len(ids) > self.max_model_len:
            raise RequestError(f"input has {len(ids)} tokens; max_model_len is {self.max_model_len}")

    @torch.inference_mode()
    def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        """One right-padded forward over ``token_ids`` (B lists); returns float32 ``[B, dim]`` on CPU."""
        lens = [len(t) for t in token_ids]
        width = max(lens)
        ids = torch.full((len(token_ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(token_ids), width), dtype=torch.long)
        for i, t in enumerate(token_ids):
            ids[i, :lens[i]] = torch.tensor(t, dtype=torch.long)
            mask[i, :lens[i]] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        kwargs = {}
        if getattr(self.config, "type_vocab_size", 0):
            kwargs["token_type_ids"] = torch.zeros_like(ids)
        out = self.model(input_ids=ids, attention_mask=mask, **kwargs)
        return pool(out.last_hidden_state, mask, self.recipe["mode"], self.recipe["normalize"]).cpu()


class PoolingScheduler(BaseScheduler):
    """The scheduler of a pooling replica: each step is one batched encoder forward instead of prefill + decode.

    Batching: each step takes waiting requests in arrival order while ``len(group) < max_num_seqs`` and the
    padded size ``len(group) × longest`` stays within ``max_num_batched_tokens`` (the first always runs).
    Every request leaves the engine in the step that runs it, so nothing is active between steps. Acceptance outputs
    go out with the step's results (one Redis round trip per step, one message per api process): a step is a
    single forward, far inside the api's acceptance grace.

    Args:
        runner: a loaded ``PoolingRunner``.
        engine_id, stats, max_num_seqs: as ``BaseScheduler``.
        max_num_batched_tokens: padded tokens (``len(group) × longest``) one forward takes at most.
    """

    flush_before_step = False

    def __init__(self, runner: PoolingRunner, engine_id: str, stats: EngineStats, *, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 4096):
        super().__init__(engine_id, stats, max_num_seqs, runner.max_model_len)
        self.runner = runner
        self.max_num_batched_tokens = max_num_batched_tokens

    def _prepare(self, seq: Sequence) -> None:
        self.runner.prepare(seq)

    def active(self) -> list[Sequence]:
        return []  # every request leaves in the step that runs it

    def _abort_active(self, ids: set[str]) -> None:
        pass  # nothing is active between steps

    def _forget_all(self) -> None:
        pass

    def step(self) -> Iterator[Outputs]:
        """Encode one batch of waiting requests; yields one finished output per request (one forward: one part)."""
        self._encode()
        yield self._take()

    def _encode(self) -> None:
        group: list[Sequence] = []
        longest = 0
        while self.waiting and len(group) < self.max_num_seqs:
            n = len(self.waiting[0].request.prompt_token_ids)
            if group and (len(group) + 1) * max(longest, n) > self.max_num_batched_tokens:
                break
            group.append(self.waiting.popleft())
            longest = max(longest, n)
        if not group:
            return
        ts = now()
        t0 = time.perf_counter()
        for s in group:
            s.scheduled_ts = ts
        try:
            vecs = self.runner.embed([s.request.prompt_token_ids for s in group])
        except Exception as exc:  # fail this batch only
            log.exception("pooling forward failed")
            for s in group:
                self._finish_out(s, FINISH_ERROR, f"encode failed: {exc}")
            return
        dt = time.perf_counter() - t0
        ntok = sum(len(s.request.prompt_token_ids) for s in group)
        self.stats.prompt_tokens += ntok  # /metrics engine_prompt_tokens_total, as the generative engine counts
        self.stats.prefill_tokens_per_s = ema(self.stats.prefill_tokens_per_s, ntok / max(dt, 1e-9))
        done = now()
        arr = vecs.numpy().astype("<f4", copy=False)
        for i, s in enumerate(group):
            s.finish_reason = FINISH_STOP
            self._emit(s.request.client_id, EngineCoreOutput(
                request_id=s.request_id, finish_reason=FINISH_STOP, scheduled_ts=ts, first_token_ts=done,
                engine_id=self.engine_id, pooled=arr[i].tobytes()))
