"""Build the tiny demo / test causal LM (docs/ARCHITECTURE.md §5, §9).

A Qwen3-architecture model (hidden 128, head_dim 32, 4 heads / 2 KV heads, 2 layers, MLP 256) whose
vocabulary covers every id of a real Qwen3 tokenizer (rounded up to a multiple of 128, as Qwen's own
checkpoints pad theirs), random weights from ``torch.manual_seed(0)``, saved with ``save_pretrained``
(safetensors) together with ``generation_config.json`` (EOS = ``<|im_end|>`` and ``<|endoftext|>``)
and the tokenizer files, so the output is a complete Hugging Face-format directory.

Usage::

    python scripts/build_demo_model.py --tokenizer-dir .cache/tokenizers/qwen3 \
        --out .cache/models/tiny-qwen3 [--force]

Idempotent: an existing output directory holding ``config.json`` is left alone unless ``--force``.
Deterministic: the same tokenizer files give byte-identical weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_vocab_size(tokenizer_dir: Path) -> int:
    """Number of ids the tokenizer can emit, added tokens included (max id + 1)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    return max(vocab.values()) + 1


def eos_ids(tokenizer_dir: Path) -> list[int]:
    """EOS ids for the generation config: ``<|im_end|>`` and ``<|endoftext|>`` when present, else the
    tokenizer config's ``eos_token``. Raises ``ValueError`` when none can be found."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids: list[int] = []
    for name in ("<|im_end|>", "<|endoftext|>"):
        tid = tok.token_to_id(name)
        if tid is not None:
            ids.append(tid)
    if not ids:
        cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
        eos = cfg.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        tid = tok.token_to_id(eos) if eos else None
        if tid is None:
            raise ValueError(f"no EOS token found in {tokenizer_dir}")
        ids.append(tid)
    return ids


def build(tokenizer_dir: Path, out: Path, force: bool = False) -> Path:
    """Build the demo model into ``out`` (see module docstring); returns ``out``.

    Raises ``FileNotFoundError`` when the tokenizer files are missing.
    """
    for name in TOKENIZER_FILES:
        if not (tokenizer_dir / name).is_file():
            raise FileNotFoundError(tokenizer_dir / name)
    if (out / "config.json").is_file() and not force:
        print(f"{out} exists; use --force to rebuild")
        return out

    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    raw_vocab = tokenizer_vocab_size(tokenizer_dir)
    vocab_size = (raw_vocab + 127) // 128 * 128
    eos = eos_ids(tokenizer_dir)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        head_dim=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        num_hidden_layers=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos[0],
        pad_token_id=eos[-1],
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=eos[-1], do_sample=False, max_new_tokens=64
    )
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, tmp / name)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"built {out}: vocab {vocab_size} (tokenizer {raw_vocab}), eos {eos}")
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer-dir", type=Path, default=Path(".cache/tokenizers/qwen3"))
    ap.add_argument("--out", type=Path, default=Path(".cache/models/tiny-qwen3"))
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    build(args.tokenizer_dir, args.out, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
