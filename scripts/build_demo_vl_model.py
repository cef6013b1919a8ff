"""Build the tiny demo / test vision-language model (issue 6).

A Qwen2-VL-architecture model (``Qwen2VLForConditionalGeneration``): text part hidden 128, 4 heads / 2 KV
heads, 2 layers; vision tower depth 1, embed 64, 2 heads, patch 14, spatial merge 2 (one image token per
28×28 pixels). Vocabulary covers every id of the real Qwen3 tokenizer (which has ``<|vision_start|>``
151652, ``<|vision_end|>`` 151653 and ``<|image_pad|>`` 151655, the ids Qwen2-VL uses). Random weights from
``torch.manual_seed(0)``, saved with ``save_pretrained`` (safetensors), plus:

* ``preprocessor_config.json``: a ``Qwen2VLImageProcessor`` (the Pillow backend, no torchvision) with ``min_pixels = 4·28²`` and
  ``max_pixels = 64·28²`` (so an image becomes 4 to 64 image tokens);
* the tokenizer files, with ``tokenizer_config.json``'s ``chat_template`` replaced by Qwen2-VL's own
  template, which places ``<|vision_start|><|image_pad|><|vision_end|>`` for each image part (the
  platform expands the single ``<|image_pad|>`` to the number of tokens the processor produces);
* ``generation_config.json`` (EOS ``<|im_end|>``, ``<|endoftext|>``).

Usage::

    python scripts/build_demo_vl_model.py --tokenizer-dir .cache/tokenizers/qwen3 \
        --out .cache/models/tiny-qwen2-vl [--force]

Idempotent unless ``--force``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Qwen2-VL-7B-Instruct's chat template (tokenizer_config.json of Qwen/Qwen2-VL-7B-Instruct).
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MIN_PIXELS = 4 * 28 * 28
MAX_PIXELS = 64 * 28 * 28


def build(tokenizer_dir: Path, out: Path, force: bool = False) -> Path:
    """Build the demo VL model into ``out``; returns ``out``. Raises ``FileNotFoundError`` without the
    tokenizer files."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (tokenizer_dir / name).is_file():
            raise FileNotFoundError(tokenizer_dir / name)
    if (out / "config.json").is_file() and not force:
        print(f"{out} exists; use --force to rebuild")
        return out

    import torch
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    vocab_size = (max(vocab.values()) + 1 + 127) // 128 * 128
    ids = {name: tok.token_to_id(name) for name in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                      "<|video_pad|>", "<|im_end|>", "<|endoftext|>")}
    if None in ids.values():
        raise ValueError(f"tokenizer lacks a Qwen-VL token: {ids}")
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    config = Qwen2VLConfig(
        text_config={"vocab_size": vocab_size, "hidden_size": 128, "intermediate_size": 256,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default",
                     "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
                     "eos_token_id": eos[0], "bos_token_id": ids["<|endoftext|>"], "tie_word_embeddings": True},
        vision_config={"depth": 1, "embed_dim": 64, "hidden_size": 128, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    GenerationConfig(eos_token_id=eos, bos_token_id=ids["<|endoftext|>"]).save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                          size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}).save_pretrained(out)
    (out / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN2_VL_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    print(f"built {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer-dir", type=Path, default=Path(".cache/tokenizers/qwen3"))
    ap.add_argument("--out", type=Path, default=Path(".cache/models/tiny-qwen2-vl"))
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    build(args.tokenizer_dir, args.out, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
