"""Model runner for Qwen-VL-architecture vision-language models (issue 6).

Extends ``ModelRunner`` (same right-aligned batch KV cache, same sampling) with:

* loading through ``AutoModelForImageTextToText``;
* images: each request's ``mm_cache_keys`` name processed features in the shared cache
  (``inference.media.cache``), read in ``prepare`` (the pixels never cross the engine link); the prompt
  must hold exactly ``num_tokens`` image placeholder ids per image;
* M-RoPE: prefill positions come from the model's own ``get_rope_index`` (3 × B × T, vision tokens get
  temporal/height/width positions); each row keeps its ``rope_delta`` so decode positions are
  ``num_computed + rope_delta`` in all three sections.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from inference.media.cache import FeatureCache

from .runner import ModelRunner, RequestError, Sequence


def is_vision_language(model_dir: str) -> bool:
    """True when ``config.json`` describes a model with a vision tower (``vision_config``)."""
    try:
        return "vision_config" in json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False


class VLModelRunner(ModelRunner):
    """``ModelRunner`` for Qwen2-VL-style models. ``redis_url``/``link_prefix`` locate the feature cache."""

    def __init__(self, model_dir: str, device: str = "cpu", dtype: str = "float32",
                 max_model_len: int | None = None, redis_url: str = "redis://127.0.0.1:6379/0",
                 link_prefix: str = "llmp"):
        import redis
        from transformers import AutoModelForImageTextToText

        super().__init__(model_dir, device=device, dtype=dtype, max_model_len=max_model_len,
                         auto_class=AutoModelForImageTextToText)
        cfg = self.config
        self.image_token_id = int(cfg.image_token_id)
        self.row_deltas: torch.Tensor | None = None  # [B] long, M-RoPE delta per batch row
        self.features = FeatureCache(redis.Redis.from_url(redis_url), link_prefix)

    def prepare(self, seq: Sequence) -> None:
        """``ModelRunner.prepare`` plus the images: load each key's features; the prompt must carry exactly
        their token counts. Raises ``RequestError`` (missing/evicted features, count mismatch)."""
        super().prepare(seq)
        keys = list(seq.request.mm_cache_keys or [])
        n_placeholders = sum(1 for t in seq.request.prompt_token_ids if t == self.image_token_id)
        feats = []
        for k in keys:
            f = self.features.get(k)
            if f is None:
                raise RequestError("image features are no longer in the multimodal cache; retry the request")
            feats.append(f)
        if n_placeholders != sum(f.num_tokens for f in feats):
            raise RequestError(f"prompt has {n_placeholders} image tokens but its images need "
                               f"{sum(f.num_tokens for f in feats)}")
        seq.mm_features = feats  # type: ignore[attr-defined]

    def remove_rows(self, keep: list[int]) -> None:
        """As ``ModelRunner.remove_rows``, keeping the rows' M-RoPE deltas aligned."""
        if self.row_deltas is not None:
            self.row_deltas = self.row_deltas[keep] if keep else None
        super().remove_rows(keep)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Left-padded forward of ``seqs`` with their images; appends them to the batch. Returns float32
        logits ``[len(seqs), vocab]``."""
        from transformers import DynamicCache

        lens = [len(s.request.prompt_token_ids) for s in seqs]
        width = max(lens)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - lens[i]:] = torch.tensor(s.request.prompt_token_ids, dtype=torch.long)
            mask[i, width - lens[i]:] = 1
        feats = [f for s in seqs for f in getattr(s, "mm_features", [])]
        ids, mask = ids.to(self.device), mask.to(self.device)
        mm_types = (ids == self.image_token_id).to(torch.int32) * mask.to(torch.int32)
        grid = torch.tensor([f.grid_thw for f in feats], dtype=torch.long, device=self.device) if feats else None
        pos, deltas = self.model.model.get_rope_index(ids, mm_token_type_ids=mm_types, image_grid_thw=grid,
                                                      attention_mask=mask)
        kwargs = {}
        if feats:
            kwargs["pixel_values"] = torch.from_numpy(np.concatenate([f.pixel_values for f in feats])).to(
                self.device, self.dtype)
            kwargs["image_grid_thw"] = grid
            kwargs["mm_token_type_ids"] = mm_types
        cache = DynamicCache(config=self.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                         logits_to_keep=1, **kwargs)
        for s, n in zip(seqs, lens):
            s.num_computed = n
            s.mm_features = []  # type: ignore[attr-defined]  # pixels are not needed after prefill
        deltas = deltas.view(-1).to(torch.long)
        self.row_deltas = deltas if self.row_deltas is None else torch.cat([self.row_deltas, deltas])
        self._merge(cache, mask)
        return out.logits[:, -1, :].float()

    @torch.inference_mode()
    def decode(self, last_tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step; positions are shifted by each row's M-RoPE delta and repeated over the three
        sections. Returns float32 logits ``[B, vocab]``."""
        b = self.batch_size
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device).view(b, 1)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device) + self.row_deltas
        pos = pos.view(1, b, 1).expand(3, b, 1)
        self.mask = torch.cat([self.mask, self.mask.new_ones((b, 1))], 1)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=pos, cache=self.cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].float()
