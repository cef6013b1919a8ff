"""Model runner for Qwen-VL-architecture vision-language models.

Extends ``ModelRunner`` (same slot KV cache, same sampling; prompts are prefilled whole, never in chunks) with:

* loading through ``AutoModelForImageTextToText``;
* images: each request's ``mm_cache_keys`` name processed features in the shared cache
  (``inference.media.cache``), read in ``prepare`` (the pixels never cross the engine link); the prompt
  must hold exactly ``num_tokens`` image placeholder ids per image;
* an encoder cache (``encoder_cache.EncoderCache``): the vision tower's output per image key, so an image
  seen before costs neither a Redis read of its pixels nor a vision-tower pass; prefill hands the image
  embeddings to the model as ``mm_encoder_outputs``;
* prefix caching (``prefix_cache.py``): block hashes carry the keys of the images they cover, so a prompt
  with the same text and the same images reuses the K/V; images wholly inside the reused prefix are not
  encoded at all;
* M-RoPE: prefill positions come from the model's own ``get_rope_index`` (3 × B × T, vision tokens get
  temporal/height/width positions); each sequence keeps its ``rope_delta`` so decode positions are
  ``num_computed + rope_delta`` in all three sections.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from inference.media.cache import FeatureCache, ImageFeatures

from .encoder_cache import EncodedImage, EncoderCache
from .prefix_cache import DEFAULT_PREFIX_CACHE_MB, ImageSpan
from .runner import ModelRunner, RequestError, _last_logits, left_padded
from .sequence import Sequence

def is_vision_language(model_dir: str) -> bool:
    """True when ``config.json`` describes a model with a vision tower (``vision_config``)."""
    try:
        return "vision_config" in json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False


# one image of a prompt: (content key, its encoder-cache embeddings, else its processed features)
_Image = tuple[str, EncodedImage | None, ImageFeatures | None]


class VLModelRunner(ModelRunner):
    """``ModelRunner`` for Qwen2-VL-style models. ``redis_url``/``link_prefix`` locate the feature cache."""

    def __init__(self, model_dir: str, device: str = "cpu", dtype: str = "float32",
                 max_model_len: int | None = None, redis_url: str = "redis://127.0.0.1:6379/0",
                 link_prefix: str = "llmp", prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB):
        import redis
        from transformers import AutoModelForImageTextToText

        super().__init__(model_dir, device=device, dtype=dtype, max_model_len=max_model_len,
                         auto_class=AutoModelForImageTextToText, prefix_cache_mb=prefix_cache_mb)
        cfg = self.config
        self.image_token_id = int(cfg.image_token_id)
        self.features = FeatureCache(redis.Redis.from_url(redis_url), link_prefix)
        self.encoder_cache = EncoderCache()

    def prepare(self, seq: Sequence) -> None:
        """``ModelRunner.prepare`` plus the images: per key, the encoder cache's embeddings or else the
        processed features from the shared cache; the prompt must carry exactly their token counts.
        Raises ``RequestError`` (missing/evicted features, count mismatch, prompt logprobs: the chunked
        full-logits prefill uses plain positions, not M-RoPE)."""
        super().prepare(seq)
        if seq.params.prompt_logprobs is not None:
            raise RequestError("prompt logprobs are not supported for vision-language models")
        keys = list(seq.request.mm_cache_keys or [])
        n_placeholders = sum(1 for t in seq.request.prompt_token_ids if t == self.image_token_id)
        images: list[_Image] = []  # (key, encoded, features)
        n_image_tokens = 0
        for k in keys:
            encoded = self.encoder_cache.get(k)
            if encoded is not None:
                images.append((k, encoded, None))
                n_image_tokens += int(encoded.embeds.shape[0])
                continue
            f = self.features.get(k)
            if f is None:
                raise RequestError("image features are no longer in the multimodal cache; retry the request")
            images.append((k, None, f))
            n_image_tokens += f.num_tokens
        if n_placeholders != n_image_tokens:
            raise RequestError(f"prompt has {n_placeholders} image tokens but its images need {n_image_tokens}")
        seq.mm_images = images  # type: ignore[attr-defined]

    def image_spans(self, seq: Sequence) -> list[ImageSpan]:
        """Each image's placeholder span in ``seq``'s prompt: the image-token positions, taken in order, the
        first image's count for the first image, and so on (the template writes each image's placeholders as
        one run). Needs ``prepare`` to have run."""
        images = getattr(seq, "mm_images", None) or []
        if not images:
            return []
        where = np.flatnonzero(np.asarray(seq.request.prompt_token_ids) == self.image_token_id)
        spans, at = [], 0
        for key, encoded, feats in images:
            count = int(encoded.embeds.shape[0]) if encoded is not None else int(feats.num_tokens)
            spans.append(ImageSpan(int(where[at]), int(where[at + count - 1]) + 1, key))
            at += count
        return spans

    # M-RoPE positions and image embeddings are computed for the whole prompt: no chunked prefill
    supports_chunked_prefill = False

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Left-padded forward of ``seqs`` with their images into their KV slots (or, for one sequence with a cached
        prefix, ``_prefill_cached``). Returns float32 logits ``[len(seqs), vocab]``; gives the slots back on an
        error."""
        try:
            if len(seqs) == 1 and seqs[0].prefix_entry is not None:
                return self._prefill_cached(seqs[0])
            return self._prefill_fresh(seqs)
        except BaseException:
            self.release(seqs)
            raise

    def _prefill_fresh(self, seqs: list[Sequence]) -> torch.Tensor:
        ids, mask = left_padded(seqs, self.device)
        images = [img for s in seqs for img in getattr(s, "mm_images", [])]
        mm_types = (ids == self.image_token_id).to(torch.int32) * mask.to(torch.int32)
        encoded = self._encode(images)
        grid = torch.tensor([e.grid_thw for e in encoded], dtype=torch.long, device=self.device) if images else None
        pos, deltas = self.model.model.get_rope_index(ids, mm_token_type_ids=mm_types, image_grid_thw=grid,
                                                      attention_mask=mask)
        out = self._forward_fresh(seqs, ids, mask, position_ids=pos, **self._mm_kwargs(encoded))
        for s in seqs:
            s.num_computed = len(s.request.prompt_token_ids)
        self._finish_prefill(seqs, deltas)
        return _last_logits(out)

    def _prefill_cached(self, seq: Sequence) -> torch.Tensor:
        """Prefill one sequence after its cached prefix (``num_cached_tokens`` positions): M-RoPE positions come
        from the whole prompt; only images that end after the prefix are encoded (or taken from the encoder
        cache), and an image cut by the prefix contributes the embeddings of its placeholders after the cut."""
        ids_list = seq.request.prompt_token_ids
        n, p = len(ids_list), seq.num_cached_tokens
        images = getattr(seq, "mm_images", [])
        spans = self.image_spans(seq)
        ids = torch.tensor([ids_list], dtype=torch.long, device=self.device)
        grid = None
        if images:
            grid = torch.tensor([enc.grid_thw if enc is not None else list(f.grid_thw) for _k, enc, f in images],
                                dtype=torch.long, device=self.device)
        mm_types = (ids == self.image_token_id).to(torch.int32)
        pos, deltas = self.model.model.get_rope_index(ids, mm_token_type_ids=mm_types, image_grid_thw=grid,
                                                      attention_mask=torch.ones_like(ids))
        # images wholly in the prefix are not needed; one that straddles its end gives its remaining rows
        after = [(img, sp) for img, sp in zip(images, spans) if sp.end > p]
        encoded = [EncodedImage(embeds=e.embeds[max(0, p - sp.start):], grid_thw=e.grid_thw)
                   for e, (_img, sp) in zip(self._encode([img for img, _sp in after]), after)]
        self._load_prefix(seq)
        out = self._forward_single(seq, ids[0, p:], p, position_ids=pos[..., p:], **self._mm_kwargs(encoded))
        seq.num_computed = n
        self._finish_prefill([seq], deltas)
        return _last_logits(out)

    @staticmethod
    def _mm_kwargs(encoded: list[EncodedImage]) -> dict[str, Any]:
        """The model's ``mm_encoder_outputs`` argument for already encoded images (empty without images)."""
        if not encoded:
            return {}
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        # one tensor per image: the model takes a tuple where the dataclass field is typed as one tensor
        return {"mm_encoder_outputs": {"image": BaseModelOutputWithPooling(
            pooler_output=cast(Any, tuple(e.embeds for e in encoded)))}}

    def _finish_prefill(self, seqs: list[Sequence], deltas: torch.Tensor) -> None:
        """Offer the prompts to the prefix cache, drop their images and keep their M-RoPE deltas."""
        self._store_prefixes(seqs)
        for s, d in zip(seqs, deltas.view(-1).tolist()):
            s.mm_images = []  # type: ignore[attr-defined]  # pixels are not needed after prefill
            s.rope_delta = int(d)

    def _encode(self, images: list[_Image]) -> list[EncodedImage]:
        """``EncodedImage`` per image, in order: cached ones as they are, the others from one vision-tower
        pass over their pixels (then cached under their keys)."""
        out: list[EncodedImage | None] = [encoded for _key, encoded, _feats in images]
        todo = [i for i, (_key, encoded, _feats) in enumerate(images) if encoded is None]
        if todo:
            feats = [cast(ImageFeatures, images[i][2]) for i in todo]  # not encoded: features (``prepare``)
            pixels = torch.from_numpy(np.concatenate([f.pixel_values for f in feats])).to(self.device, self.dtype)
            grid = torch.tensor([f.grid_thw for f in feats], dtype=torch.long, device=self.device)
            embeds = self.model.model.get_image_features(pixels, grid, return_dict=True).pooler_output
            for i, f, e in zip(todo, feats, embeds):
                # clone: ``e`` is a view of the whole batch's output, which must not stay alive in the cache
                out[i] = enc = EncodedImage(embeds=e.clone(), grid_thw=[int(x) for x in f.grid_thw])
                self.encoder_cache.put(images[i][0], enc)
        return out  # type: ignore[return-value]

    def _positions(self, pos: torch.Tensor) -> torch.Tensor:
        """Decode positions ``[B, 1]`` (``num_computed + rope_delta``) repeated over the three M-RoPE sections."""
        return pos.view(1, *pos.shape).expand(3, *pos.shape)
