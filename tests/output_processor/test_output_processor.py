"""IncrementalDetokenizer and StopChecker over real token sequences (Qwen3, Llama 2)."""

from __future__ import annotations

import random

import pytest

from inference.api.output_processor import IncrementalDetokenizer, StopChecker
from inference.renderer.chat_template import render_chat
from inference.renderer.errors import TokenIdError
from inference.renderer.tokenizer_cache import get_tokenizer
from tests.renderer.tokdirs import tok_dir

SAMPLES = [
    "Hello 😀🎉 world! 你好，世界。🇫🇷👩‍👩‍👧",
    "日本語のテキストと絵文字🍣🍜を混ぜる。한국어도 조금.",
    "plain ascii text with numbers 12345 and symbols #$%^&*",
    "emoji only: 🧑‍🚀🧑‍🚀🧑‍🚀🫠🫠 and trailing CJK 龍",
    "Ελληνικά, русский, العربية, עברית, हिन्दी — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙",
]


@pytest.fixture(scope="module")
def qwen():
    return get_tokenizer(tok_dir("qwen3"))


@pytest.fixture(scope="module")
def qwen_prompt(qwen):
    return render_chat(tok_dir("qwen3"), [{"role": "user", "content": "Say something"}]).prompt_token_ids


def chunked(ids, rng, max_chunk):
    i = 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        yield ids[i : i + n]
        i += n


def run_detok(tok, prompt, ids, chunks, skip=True):
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    pieces = [det.push(c) for c in chunks]
    pieces.append(det.flush())
    return pieces, det


def test_samples_really_split_characters_across_tokens(qwen):
    # Guard: the property tests below only mean something if single tokens carry partial UTF-8.
    split = 0
    for text in SAMPLES:
        for t in qwen.encode(text, add_special_tokens=False):
            if "\ufffd" in qwen.decode([t]):
                split += 1
    assert split >= 10


@pytest.mark.parametrize("text", SAMPLES)
def test_detokenizer_chunking_invariance_and_no_partial_chars(qwen, qwen_prompt, text):
    ids = qwen.encode(text, add_special_tokens=False) + [qwen.eos_token_id]
    expected = qwen.decode(ids, skip_special_tokens=True)
    assert expected == text
    one_by_one, det = run_detok(qwen, qwen_prompt, ids, [[t] for t in ids])
    assert "".join(one_by_one) == expected
    assert det.output_text == expected and det.output_token_ids == ids
    assert all("\ufffd" not in p for p in one_by_one)
    all_at_once, _ = run_detok(qwen, qwen_prompt, ids, [ids])
    assert "".join(all_at_once) == expected
    rng = random.Random(hash(text) & 0xFFFF)
    for _ in range(20):
        pieces, _ = run_detok(qwen, qwen_prompt, ids, list(chunked(ids, rng, 5)))
        assert "".join(pieces) == expected
        assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_kept_when_not_skipped(qwen, qwen_prompt):
    ids = qwen.encode("hi", add_special_tokens=False) + [qwen.eos_token_id]
    pieces, _ = run_detok(qwen, qwen_prompt, ids, [[t] for t in ids], skip=False)
    assert "".join(pieces) == "hi<|im_end|>"


def test_incomplete_character_is_flushed_as_replacement(qwen, qwen_prompt):
    ids = qwen.encode("a🫠", add_special_tokens=False)
    partial = ids[:-1]
    assert "\ufffd" in qwen.decode(partial)
    det = IncrementalDetokenizer(qwen, qwen_prompt)
    assert det.push(partial) == "a"
    assert det.flush().endswith("\ufffd")


def test_out_of_range_token(qwen, qwen_prompt):
    det = IncrementalDetokenizer(qwen, qwen_prompt)
    with pytest.raises(TokenIdError):
        det.push([qwen.vocab_size + 5])


def test_sentencepiece_leading_spaces_use_prompt_context():
    tok = get_tokenizer(tok_dir("llama2"))
    full = tok.encode("The quick brown fox jumps", add_special_tokens=True)
    prompt, out = full[:3], full[3:]
    pieces, _ = run_detok(tok, prompt, out, [[t] for t in out])
    assert "".join(pieces) == tok.decode(full, True)[len(tok.decode(prompt, True)) :]
    assert "".join(pieces).startswith(" ")


def test_detokenizer_window_stays_small_and_fast(qwen, qwen_prompt):
    ids = qwen.encode(" ".join(SAMPLES) * 40, add_special_tokens=False)
    assert len(ids) > 4000
    det = IncrementalDetokenizer(qwen, qwen_prompt)
    for t in ids:
        det.push([t])
        assert len(det._ids) < 80  # O(window) per token, not O(output): the work per token stays bounded
    det.flush()
    assert det.output_text == qwen.decode(ids)


# ----------------------------------------------------------------------------------------------
# StopChecker
# ----------------------------------------------------------------------------------------------
def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Whole-text semantics: cut at the earliest stop occurrence (shortest on ties)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i != -1 and (best is None or i < best[0] or (i == best[0] and len(s) < len(best[1]))):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return text[: i + len(s)] if include else text[:i], s


def run_stop(pieces: list[str], stops, include):
    sc = StopChecker(stops, include)
    out, matched = [], None
    for p in pieces:
        emit, m = sc.push(p)
        out.append(emit)
        if m is not None:
            matched = m
            break
    if matched is None:
        emit, matched = sc.flush()
        out.append(emit)
    return "".join(out), matched, out


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_property_random(include):
    rng = random.Random(1234 + include)
    alphabet = "ab世😀 "
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = []
        for _ in range(rng.randint(1, 3)):
            if text and rng.random() < 0.7:
                i = rng.randrange(len(text))
                stops.append(text[i : i + rng.randint(1, 4)])
            else:
                stops.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))))
        stops = [s for s in stops if s]
        expected = reference_stop(text, stops, include)
        for _ in range(4):
            pieces, i = [], 0
            while i < len(text):
                n = rng.randint(1, 4)
                pieces.append(text[i : i + n])
                i += n
            got_text, got_stop, _ = run_stop(pieces, stops, include)
            assert (got_text, got_stop) == expected, (text, stops, pieces)


def test_stop_holds_back_possible_prefix():
    sc = StopChecker(["</answer>"], False)
    assert sc.push("The answer is 4</ans") == ("The answer is 4", None)
    assert sc.push("wer> trailing") == ("", "</answer>")
    assert sc.push("more") == ("", "</answer>")
    sc = StopChecker(["</answer>"], False)
    assert sc.push("x</a") == ("x", None)
    assert sc.push("b") == ("</ab", None)  # not a stop after all: released
    assert sc.flush() == ("", None)
    # A complete match waits while an earlier-starting stop could still complete; flush decides.
    sc = StopChecker(["b", "abc"], False)
    assert sc.push("xab") == ("x", None)
    assert sc.flush() == ("a", "b")
    sc = StopChecker(["b", "abc"], False)
    assert sc.push("xab") == ("x", None)
    assert sc.push("cd") == ("", "abc")
    sc = StopChecker(["STOP"], True)
    assert sc.push("abcST") == ("abcST", None)  # include mode needs no holdback
    assert sc.push("OPxyz") == ("OP", "STOP")


def test_stop_on_real_qwen_tokens_split_across_tokens(qwen, qwen_prompt):
    text = "Answer: 你好，世界🌍 then more text after"
    ids = qwen.encode(text, add_special_tokens=False)
    for stop, include in (("世界🌍", False), ("世界🌍", True), ("🌍 then", False), ("after", True)):
        expected = reference_stop(text, [stop], include)
        results = set()
        for chunks in ([[t] for t in ids], [ids], list(chunked(ids, random.Random(7), 3))):
            det = IncrementalDetokenizer(qwen, qwen_prompt)
            sc = StopChecker([stop], include)
            out, matched = [], None
            for c in chunks:
                emit, matched = sc.push(det.push(c))
                out.append(emit)
                if matched:
                    break
            if not matched:
                emit, matched = sc.push(det.flush())
                out.append(emit)
            if not matched:
                emit, matched = sc.flush()
                out.append(emit)
            results.add(("".join(out), matched))
        assert results == {expected}, (stop, include, results)


def test_no_stop_strings_passthrough_and_validation():
    sc = StopChecker([], False)
    assert sc.push("abc") == ("abc", None)
    with pytest.raises(ValueError):
        StopChecker([""], False)
