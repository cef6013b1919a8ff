"""all-MiniLM-L6-v2 run directly with transformers: the reference the platform's vectors must match (tests) and the
baseline its embeddings throughput is measured against (bench/multimodal.py). Its directory: ``harness.assets.minilm_dir``."""

from __future__ import annotations

import torch
from transformers import AutoModel, AutoTokenizer


class DirectMiniLM:
    """sentence-transformers' recipe done by hand: tokenize (max 256), BertModel, mean pooling over the
    attention mask, L2 normalisation."""

    def __init__(self, model_dir: str):
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def embed(self, texts: list[str], max_length: int = 256) -> torch.Tensor:
        """float32 ``[len(texts), 384]``."""
        enc = self.tok(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        hidden = self.model(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=-1)
