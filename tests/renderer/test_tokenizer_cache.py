"""LoadedTokenizer vs transformers' AutoTokenizer on the six real tokenizers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from inference.renderer.chat_template import detokenize, render_chat, tokenize_prompt
from inference.renderer.errors import TokenIdError, TokenizerLoadError
from inference.renderer.tokenizer_cache import cached_tokenizer, get_tokenizer, load_tokenizer
from tests.renderer.tokdirs import NAMES, hf_tokenizer, tok_dir

ROOT = Path(__file__).resolve().parents[2]

TEXTS = [
    "Hello world",
    " leading space",
    "  two  spaces  ",
    "héllo 😀 世界\n\n  x",
    "e\u0301 (NFD) vs \u00e9",
    "<|im_start|>user hi<s></s><bos><mask><|begin_of_text|>",
    "",
    "\t\ttab\r\nCRLF",
    "def f(x):\n    return x ** 2  # comment",
    "🇫🇷👩‍👩‍👧 ZWJ sequences",
    "1234567890 3.14159 1e-9",
]


@pytest.mark.parametrize("name", NAMES)
def test_encode_decode_match_transformers(name):
    hf = hf_tokenizer(name)
    lt = get_tokenizer(tok_dir(name))
    for text in TEXTS:
        for add in (True, False):
            assert lt.encode(text, add_special_tokens=add) == hf(text, add_special_tokens=add)["input_ids"], (text, add)
        ids = hf(text, add_special_tokens=True)["input_ids"]
        for skip in (True, False):
            assert lt.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (text, skip)
    assert lt.vocab_size == len(hf)
    assert lt.special_tokens_map == hf.special_tokens_map
    assert lt.all_special_ids == hf.all_special_ids
    assert lt.bos_token_id == hf.bos_token_id and lt.eos_token_id == hf.eos_token_id
    assert lt.pad_token_id == hf.pad_token_id and lt.unk_token_id == hf.unk_token_id
    assert lt.chat_template == hf.chat_template
    probe = hf("a", add_special_tokens=True)["input_ids"]
    assert lt.add_bos_token == (hf.bos_token_id is not None and probe[0] == hf.bos_token_id)
    assert lt.id_to_token(lt.vocab_size - 1) == hf.convert_ids_to_tokens(lt.vocab_size - 1)
    # The character pre-check bound holds for these texts.
    for text in TEXTS:
        assert len(lt.encode(text, False)) * lt.max_token_chars >= len(text)


def test_llama2_sentencepiece_rewrite_is_what_transformers_does():
    # tokenizer.json alone would give an extra "▁" (28705) before "▁leading"; transformers 5 does not.
    lt = get_tokenizer(tok_dir("llama2"))
    assert lt.encode(" leading space", add_special_tokens=True) == [1, 5374, 2764]
    assert lt.add_bos_token is True


def test_cache_is_per_process_and_keyed_by_mtime(tmp_path):
    src = tok_dir("qwen3")
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(os.path.join(src, "tokenizer.json"), d / "tokenizer.json")
    cfg = json.load(open(os.path.join(src, "tokenizer_config.json")))
    default_tpl = cfg["chat_template"]
    cfg["chat_template"] = [
        {"name": "default", "template": default_tpl},
        {"name": "tool_use", "template": "TOOLS{{ tools|length }}"},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert cached_tokenizer(str(d)) is None  # not loaded yet: the caller loads it (off the event loop)
    a = get_tokenizer(str(d))
    assert get_tokenizer(str(d)) is a and cached_tokenizer(str(d)) is a
    assert a.chat_template == default_tpl and set(a.chat_templates) == {"default", "tool_use"}
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(str(d), msgs, tools=[{"type": "function", "function": {"name": "f"}}]).prompt_text == "TOOLS1"
    assert render_chat(str(d), msgs).prompt_text.startswith("<|im_start|>user")
    assert render_chat(str(d), msgs, chat_template="tool_use", tools=[]).prompt_text == "TOOLS0"
    # chat_template.jinja wins over the config; a new mtime reloads.
    (d / "chat_template.jinja").write_text("JINJA {{ messages[0].content }}")
    os.utime(d / "tokenizer_config.json", (1, 1))
    assert cached_tokenizer(str(d)) is None  # a new revision: not loaded yet
    b = get_tokenizer(str(d))
    assert b is not a and cached_tokenizer(str(d)) is b
    assert render_chat(str(d), msgs).prompt_text == "JINJA hi"


def test_missing_directory():
    with pytest.raises(TokenizerLoadError):
        get_tokenizer("/nonexistent/tokenizer/dir")


def test_tokenize_and_detokenize_helpers():
    d = tok_dir("llama3_1")
    ids = tokenize_prompt(d, "Hello world")
    assert ids == hf_tokenizer("llama3_1")("Hello world")["input_ids"] and ids[0] == 128000
    assert tokenize_prompt(d, "Hello world", add_special_tokens=False) == ids[1:]
    assert detokenize(d, ids) == "<|begin_of_text|>Hello world"
    assert detokenize(d, ids, skip_special_tokens=True) == "Hello world"
    vocab = load_tokenizer(d).vocab_size
    with pytest.raises(TokenIdError) as exc:
        detokenize(d, [9906, vocab])
    assert str(vocab) in exc.value.message and exc.value.param == "tokens"
    with pytest.raises(TokenIdError, match="-1"):
        detokenize(d, [-1])
    with pytest.raises(TokenIdError):
        detokenize(d, ["12"])


_HEAP_PROBE = r"""
import os, sys, threading
from inference.renderer.tokenizer_cache import get_tokenizer, load_tokenizer, release_free_heap

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

lt = load_tokenizer(sys.argv[1])  # the bare load and copy: nothing gives their transient memory back
lt.text_only_tokenizer()
before = rss_mb()
assert release_free_heap()
bare = before - rss_mb()
get_tokenizer(sys.argv[1])  # the cache's load: its loading thread builds the copy, then releases
for t in threading.enumerate():
    if t.name == "tokenizer-load":
        t.join()
before = rss_mb()
release_free_heap()
print(bare, before - rss_mb())
"""


def test_a_tokenizer_load_gives_its_transient_heap_back():
    """The cache's load ends with ``release_free_heap``: what the parse of a large ``tokenizer.json`` and its
    text-only copy left free in the C heap is no longer resident. gemma3 (262k tokens, 33 MB of JSON) in a fresh
    process: the bare load leaves tens of MB to release, the cache's load leaves next to nothing."""
    from inference.renderer.tokenizer_cache import release_free_heap

    if not release_free_heap():
        pytest.skip("no malloc_trim in this C library")
    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, tok_dir("gemma3")], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=f"{ROOT / 'platform'}:{ROOT}"), timeout=120)
    assert out.returncode == 0, out.stderr
    bare, cached = map(float, out.stdout.split())
    assert bare > 40, (bare, cached)  # what a load leaves free but resident
    assert cached < 15, (bare, cached)  # the cache's load already gave it back
