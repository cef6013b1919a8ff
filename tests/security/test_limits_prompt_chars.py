"""Issue 14 follow-up: the render worker refuses, before encoding, text that cannot fit the model's context
whatever its tokenization (``max_model_len × longest token string``), and its memory for a prompt at that bound
stays within 10× the prompt's size plus a constant. Measured in a fresh process (the tokenizer allocates in Rust,
outside tracemalloc: peak RSS, ``ru_maxrss``), through the real task body ``inference.workers.tasks.run_tokenize_prompt``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / ".cache" / "models" / "tiny-qwen3"
MAX_MODEL_LEN = 1024
CONSTANT_BYTES = 64 << 20

_PROBE = """
import json, resource, sys
sys.path[:0] = ["platform", "."]
from inference.workers.tasks import prompt_char_bound, run_tokenize_prompt
d, mml, factor = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
bound = prompt_char_bound(d, mml)
run_tokenize_prompt({"tokenizer_dir": d, "prompt": "hello " * 100, "max_model_len": mml})  # warm
n = int(bound * factor)
prompt = ("hello " * (n // 6 + 1))[:n]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
r = run_tokenize_prompt({"tokenizer_dir": d, "prompt": prompt, "max_model_len": mml})
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
print(json.dumps({"bound": bound, "chars": n, "grew": grew, "result": {k: v for k, v in r.items()
                                                                      if k != "prompt_token_ids"}}))
"""


def _probe(factor: float) -> dict:
    if not (TOKENIZER / "tokenizer.json").exists():
        pytest.skip(f"{TOKENIZER} missing")
    out = subprocess.run([sys.executable, "-c", _PROBE, str(TOKENIZER), str(MAX_MODEL_LEN), str(factor)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_prompt_at_the_bound_is_tokenized_within_ten_times_its_size():
    got = _probe(1.0)
    assert got["result"]["ok"] is True, got
    assert got["grew"] <= 10 * got["chars"] + CONSTANT_BYTES, got


def test_a_prompt_over_the_bound_is_refused_before_encoding():
    got = _probe(1.01)
    assert got["result"]["ok"] is False, got
    assert got["result"]["error"]["type"] == "ContextLengthError", got
    assert got["result"]["error"]["param"] == "prompt"
    assert got["grew"] <= CONSTANT_BYTES, got
