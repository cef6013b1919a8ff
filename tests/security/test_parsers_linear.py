"""Issue 39: the output parsers and the output processor are linear in the output, and a parser's hold is bounded.

The tool-call parsers (``hermes``, ``llama3_json``, the forced ``tool_choice`` readers), the ``<think>`` reasoning
parsers, their composition (``ChatOutputParser``) and the output processor's text path (detokenizer, the choice's
text) run on the api's event loop for every text delta of every choice. They grew their texts with
``self.text += delta`` (a copy of everything so far per delta) and searched the whole held block for its end on
every delta: O(L²) per choice, every other request on that api process stalled meanwhile.

Linearity: each case feeds an output of n and of 8n characters (n = 30,000, more where the quadratic part was a
cheap copy: up to 1.9 million characters) in deltas of 1-16 characters (or whole, as the non-streamed path does)
and compares the CPU time (``time.process_time``, garbage collector off, best of several interleaved runs): 8x the
output must cost under 24x the time (linear work is about 8x, quadratic about 64x; measured on this 2-core box:
7.7-8.5x after the fix, also with both cores busy, 28-64x before). Timed rather than counted because the quadratic work was inside C string routines (the copy that
``+=`` on an attribute makes, ``str.find`` over the held block), which a count of Python line events does not see;
only in-run ratios are compared, never absolute times. Every case also checks what the parser produced.

The bound is deterministic: after every delta, the characters fed but not yet emitted (what the parser holds)
stay within ``max_held_chars`` plus the markup, and what is past the bound comes out as content.
"""

from __future__ import annotations

import gc
import json
import random
import time
from typing import Any, Callable

import pytest

from inference.api.chat_output import ChatOutputParser, ChatOutputSpec
from inference.shared.config import SETTINGS
from inference.api.output_processor import OutputProcessor, RequestState
from inference.protocol.engine import EngineCoreOutput
from inference.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from inference.renderer.tokenizer_cache import get_tokenizer
from inference.tool_parsers import HermesToolParser, Llama3JsonToolParser, get_tool_parser
from inference.tool_parsers.forced import RequiredToolParser
from tests.renderer.tokdirs import tok_dir

SMALL = 30_000
BIG = 8 * SMALL  # 240,000 characters: under the default bound (262,144), so held blocks stay held
RATIO_LIMIT = 24.0  # 8x the output: linear ~8x, quadratic ~64x
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def deltas(text: str, seed: int = 0) -> list[str]:
    """``text`` cut into deltas of 1-16 characters (a detokenizer's usual sizes)."""
    r = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        k = r.randint(1, 16)
        out.append(text[i:i + k])
        i += k
    return out


def _per_run(run: Callable[[], object], k: int) -> float:
    gc.disable()
    try:
        t0 = time.process_time()
        for _ in range(k):
            run()
        return (time.process_time() - t0) / k
    finally:
        gc.enable()


def assert_linear(case: Callable[[int], Callable[[], object]], n: int = SMALL) -> None:
    """``case(n)`` prepares a run over an output of ``n`` characters (inputs built outside the timing); the run of
    ``8 n`` must cost under ``RATIO_LIMIT`` times the run of ``n`` in one of three rounds. Where the quadratic work
    was a plain copy (``+=`` on an attribute), a cheap one next to the linear work, a case takes a larger ``n``
    (the quadratic share grows with it) to show it."""
    small, big = case(n), case(8 * n)
    small()  # warm up (imports, caches)
    t = _per_run(small, 1)
    k = max(1, min(50, int(0.02 / max(t, 1e-6))))  # repeat short runs to at least ~20 ms
    ratios = []
    for _ in range(3):
        s = min(_per_run(small, k) for _ in range(3))
        b = _per_run(big, k)
        ratios.append(round(b / max(s, 1e-9), 1))
        if ratios[-1] < RATIO_LIMIT:
            return
    pytest.fail(f"8x the output cost {ratios}x the CPU time (linear ~8x, limit {RATIO_LIMIT}x): not linear")


def feed(parser: Any, chunks: list[str]) -> list[Any]:
    """Every delta of ``parser`` (a tool or reasoning parser) for ``chunks``, then its flush."""
    return [parser.push(c) for c in chunks] + [parser.flush()]


def content(ds: list[Any]) -> str:
    return "".join(d.content for d in ds)


def calls(ds: list[Any]) -> list[Any]:
    return [c for d in ds for c in d.calls]


class Tok:
    """The little a think parser asks of a tokenizer: ``<think>``/``</think>`` ids (1, 2) for the prompt's state."""

    def token_to_id(self, token: str | None) -> int | None:
        return {"<think>": 1, "</think>": 2}.get(token or "")

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join({1: "<think>", 2: "</think>"}.get(i, "x") for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0] * len(text)


def filler(n: int) -> str:
    """``n`` characters of prose without markup or JSON-significant characters."""
    words = "the model writes a long answer with many words and numbers 12345 in it".split()
    r = random.Random(n)
    out: list[str] = []
    size = 0
    while size < n:
        w = r.choice(words) + " "
        out.append(w)
        size += len(w)
    return "".join(out)[:n]


def json_call(n: int, *, name: str = "write_file", key: str = "arguments") -> str:
    """A ``{"name", key: {"content": ...}}`` call of exactly ``n`` characters (``n`` >= 60)."""
    head, tail = '{"name": "' + name + '", "' + key + '": {"content": "', '"}}'
    return head + filler(n - len(head) - len(tail)).replace(" ", "_") + tail


# --------------------------------------------------------------------------------------------- linearity
def test_hermes_unterminated_tool_call_is_linear():
    """An open ``<tool_call>`` that never closes (``max_tokens``): the whole block is held, then content."""
    def case(n: int) -> Callable[[], object]:
        text = "Let me check.\n" + OPEN + "\n" + filler(n)
        chunks = deltas(text)

        def run() -> None:
            ds = feed(HermesToolParser(), chunks)
            assert content(ds) == text and not calls(ds)
        return run
    assert_linear(case)


def test_hermes_long_json_call_is_linear():
    """One long call, closed at the end: one call with the arguments as written."""
    def case(n: int) -> Callable[[], object]:
        body = json_call(n)
        chunks = deltas(OPEN + "\n" + body + "\n" + CLOSE)

        def run() -> None:
            ds = feed(HermesToolParser(), chunks)
            assert content(ds) == "" and [c.arguments for c in calls(ds)] == [json.dumps(json.loads(body)["arguments"])]
        return run
    assert_linear(case)


def test_hermes_many_blocks_in_one_push_is_linear():
    """The non-streamed path: the whole output in one ``push``, many calls and text between them."""
    def case(n: int) -> Callable[[], object]:
        one = "step " + OPEN + '{"name": "f", "arguments": {"i": 1}}' + CLOSE + "\n"
        count = n // len(one)
        text = one * count

        def run() -> None:
            ds = feed(HermesToolParser(), [text])
            assert len(calls(ds)) == count and content(ds) == "step \n" * count
        return run
    assert_linear(case, 8 * SMALL)


def test_llama3_json_long_call_is_linear():
    """A long ``{"name", "parameters"}`` object after the python tag, in deltas: held until it closes."""
    def case(n: int) -> Callable[[], object]:
        body = json_call(n, key="parameters")
        chunks = deltas("<|python_tag|>" + body)

        def run() -> None:
            ds = feed(Llama3JsonToolParser(), chunks)
            assert content(ds) == "" and len(calls(ds)) == 1
        return run
    assert_linear(case)


def test_llama3_json_plain_answer_in_one_push_is_linear():
    """A plain answer pushed whole (the non-streamed path): content."""
    def case(n: int) -> Callable[[], object]:
        text = filler(n)

        def run() -> None:
            assert content(feed(Llama3JsonToolParser(), [text])) == text
        return run
    assert_linear(case)


def test_llama3_json_leading_whitespace_is_linear():
    """Whitespace at the start is held (a call may still follow); here an object ends it."""
    def case(n: int) -> Callable[[], object]:
        text = " \n" * (n // 2) + '{"name": "f", "parameters": {}}'

        def run() -> None:
            ds = feed(Llama3JsonToolParser(), deltas(text))
            assert len(calls(ds)) == 1 and content(ds) == ""
        return run
    assert_linear(case)


@pytest.mark.parametrize("cls", [Qwen3ReasoningParser, DeepSeekR1ReasoningParser])
def test_think_leading_whitespace_is_linear(cls):
    """Whitespace before a possible ``<think>`` is held until the start is decided."""
    def case(n: int) -> Callable[[], object]:
        chunks = deltas("\n" * n + "<think>why</think>answer")

        def run() -> None:
            ds = feed(cls(Tok(), [7]), chunks)
            assert "".join(d.reasoning for d in ds) == "why" and content(ds) == "answer"
        return run
    assert_linear(case)


def test_chat_output_unterminated_think_and_tool_call_is_linear():
    """Reasoning and tools composed (``ChatOutputParser``): an unterminated think block in one output, long
    reasoning then content then an unterminated ``<tool_call>`` in the other."""
    def case(n: int) -> Callable[[], object]:
        open_think = deltas("<think>" + filler(n))
        text = filler(n // 2)
        mixed = deltas("<think>" + text + "</think>" + text + OPEN + text)

        def run() -> None:
            p = ChatOutputParser(Qwen3ReasoningParser(Tok(), [7]), HermesToolParser())
            for c in open_think:
                p.push(c)
            p.finish()
            assert len(p.message_fields()["reasoning"]) == n
            p = ChatOutputParser(DeepSeekR1ReasoningParser(Tok(), [7]), HermesToolParser())
            for c in mixed:
                p.push(c)
            p.finish()
            fields = p.message_fields()
            assert fields["reasoning"] == text and fields["content"] == text + OPEN + text
        return run
    assert_linear(case, 4 * SMALL)


def test_chat_output_forced_and_whitespace_are_linear():
    """The forced ``required`` reader (the whole output held until the end) and whitespace held before calls
    (a quarter of the output: within the default bound)."""
    def case(n: int) -> Callable[[], object]:
        call = '[{"name": "f", "parameters": {"s": "' + "z" * n + '"}}]'
        forced, spaces = deltas(call), deltas(" " * (n // 4) + OPEN + '{"name": "g"}' + CLOSE)

        def run() -> None:
            p = ChatOutputParser(None, RequiredToolParser())
            for c in forced:
                p.push(c)
            p.finish()
            assert len(p.calls) == 1
            p = ChatOutputParser(None, HermesToolParser())
            for c in spaces:
                p.push(c)
            p.finish()
            assert p.message_fields()["content"] is None and len(p.calls) == 1
        return run
    assert_linear(case, 4 * SMALL)


@pytest.fixture(scope="module")
def qwen3():
    return get_tokenizer(tok_dir("qwen3"))


def test_output_processor_text_path_is_linear(qwen3):
    """Engine outputs of one token each through ``OutputProcessor`` (detokenizer, the choice's text), as the api
    applies them. Without stop strings: the stop checker's own work is counted in ``test_caps_stop_strings.py``
    (its held text is at most the longest stop string), and its cost per character would hide the copies here."""
    def case(n: int) -> Callable[[], object]:
        text = filler(n)
        ids = qwen3.encode(text, add_special_tokens=False)
        outs = [EngineCoreOutput("r-0", [t]) for t in ids[:-1]] + [EngineCoreOutput("r-0", ids[-1:],
                                                                                    finish_reason="length")]
        prompt = qwen3.encode("Hello", add_special_tokens=False)

        def run() -> None:
            state = RequestState(qwen3, prompt, ["r-0"], stop=None, include_stop_str_in_output=False,
                                 skip_special_tokens=True, arrival_time=0.0)
            proc = OutputProcessor(state)
            for out in outs:
                proc.process_outputs([out])
            assert state.choices[0].text == text and state.choices[0].detok.output_text == text
        return run
    assert_linear(case, 4 * SMALL)


# --------------------------------------------------------------------------------------------- bounded hold
def held_after_each(parser: Any, chunks: list[str], fields: tuple[str, ...] = ("content",)) -> tuple[int, list[Any]]:
    """The most characters ``parser`` held (fed but not yet emitted in ``fields``) after any delta, and its deltas.
    Only for outputs of which every character comes out again (no calls, no markers consumed)."""
    fed = emitted = most = 0
    ds = []
    for c in chunks:
        d = parser.push(c)
        ds.append(d)
        fed += len(c)
        emitted += sum(len(getattr(d, f)) for f in fields)
        most = max(most, fed - emitted)
    ds.append(parser.flush())
    return most, ds


def test_hermes_releases_a_block_longer_than_the_bound_as_content():
    """An open block past ``max_held_chars``: held no longer than the bound plus the markers, then streamed as
    content up to its ``</tool_call>``; calls after it are read again."""
    bound = 1000
    later = OPEN + '{"name": "f", "arguments": {"a": 1}}' + CLOSE
    text = "Hi " + OPEN + "x" * 50_000 + CLOSE + " and " + later
    p = HermesToolParser(max_held_chars=bound)
    fed = emitted = most = 0
    ds = []
    for c in deltas(text):
        ds.append(p.push(c))
        fed += len(c)
        emitted += len(ds[-1].content)
        if not ds[-1].calls and fed <= len(text) - len(later):
            most = max(most, fed - emitted)
    ds.append(p.flush())
    assert most <= bound + len(OPEN) + len(CLOSE)
    assert content(ds) == "Hi " + OPEN + "x" * 50_000 + CLOSE + " and "
    assert [(c.name, c.arguments) for c in calls(ds)] == [("f", '{"a": 1}')]


def test_hermes_unterminated_block_held_within_the_default_bound():
    """The registry's parser (as a request gets it) holds an open block no longer than
    ``OUTPUT_PARSER_MAX_HELD_CHARS`` (+ markup), fed past it."""
    bound = SETTINGS.output_parser_max_held_chars
    text = OPEN + "y" * (bound + 100_000)
    most, ds = held_after_each(get_tool_parser("hermes")(), deltas(text))
    assert most <= bound + len(OPEN) + len(CLOSE) and content(ds) == text


@pytest.mark.parametrize("extra", [0, 1])
def test_hermes_body_at_the_bound_is_a_call_past_it_content(extra):
    """A body of exactly ``max_held_chars`` characters is still read; one more makes the block content, closed
    or not, whatever the chunking."""
    body = json_call(500 + extra)
    for tail in (CLOSE, ""):
        text = OPEN + body + tail
        for chunks in ([text], deltas(text), list(text)):
            ds = feed(HermesToolParser(max_held_chars=500), chunks)
            assert (len(calls(ds)), content(ds)) == ((1, "") if extra == 0 else (0, text)), (tail, len(chunks))


def test_llama3_json_object_longer_than_the_bound_is_content():
    """An object past the bound turns into content (with the rest of the answer); one within it is a call."""
    bound = 1000
    big = json_call(5000, key="parameters")
    most, ds = held_after_each(Llama3JsonToolParser(max_held_chars=bound), deltas("  " + big))
    assert most <= bound and content(ds) == "  " + big and not calls(ds)
    small = json_call(bound - 2, key="parameters")
    for chunks in (["  " + small], deltas("  " + small)):
        ds = feed(Llama3JsonToolParser(max_held_chars=bound), chunks)
        assert len(calls(ds)) == 1 and content(ds) == ""
    ds = feed(Llama3JsonToolParser(max_held_chars=bound), ["   " + small])  # one character past the bound
    assert not calls(ds) and content(ds) == "   " + small


def test_think_leading_whitespace_past_the_bound_decides_the_start():
    """Whitespace longer than the bound before ``<think>``: the output does not start with a think block (qwen3:
    content; deepseek_r1: reasoning up to ``</think>``), whatever the chunking."""
    text = " " * 500 + "<think>a</think>b"
    for chunks in ([text], deltas(text), list(text)):
        most, ds = held_after_each(Qwen3ReasoningParser(Tok(), [7], max_held_chars=100), chunks, ("content",))
        assert most <= 100 + len("<think>") and content(ds) == text
        ds = feed(DeepSeekR1ReasoningParser(Tok(), [7], max_held_chars=100), chunks)
        assert ("".join(d.reasoning for d in ds), content(ds)) == (" " * 500 + "<think>a", "b")
    ds = feed(Qwen3ReasoningParser(Tok(), [7], max_held_chars=500), deltas(text))  # within the bound: thinking
    assert ("".join(d.reasoning for d in ds), content(ds)) == ("a", "b")


def test_chat_output_releases_whitespace_held_past_the_bound():
    """Whitespace before calls is held (dropped when calls follow) only up to the bound; past it, it is content."""
    call = OPEN + '{"name": "g"}' + CLOSE
    for n, expected in ((100, None), (1500, " " * 1500)):
        for chunks in ([" " * n + call], deltas(" " * n + call)):
            p = ChatOutputParser(None, HermesToolParser(max_held_chars=1000), max_held_chars=1000)
            emitted = most = fed = 0
            for c in chunks:
                emitted += len(p.push(c).content)
                fed += len(c)
                most = max(most, min(fed, n) - emitted)
            p.finish()
            assert most <= 1000 and p.message_fields()["content"] == expected and len(p.calls) == 1


def test_deeply_nested_json_is_content_not_an_error():
    """JSON nested deeper than the decoder allows (``RecursionError``, not a ``ValueError``) is content, not an
    exception out of the parser (it would end the stream)."""
    deep = "[" * 50_000 + "]" * 50_000
    ds = feed(HermesToolParser(), [OPEN + deep + CLOSE])
    assert not calls(ds) and content(ds) == OPEN + deep + CLOSE
    obj = '{"name": "f", "parameters": {"a": ' + deep + "}}"
    ds = feed(Llama3JsonToolParser(), deltas(obj))
    assert not calls(ds) and content(ds) == obj


def test_spec_parsers_use_the_configured_bound():
    """A request's parsers (``ChatOutputSpec``) take the configured bound."""
    spec = ChatOutputSpec(tokenizer=Tok(), prompt_token_ids=[7], reasoning_parser="qwen3", tool_parser="hermes",
                          tool_choice="auto", has_tools=True, parallel_tool_calls=True, chat_template_kwargs=None)
    p = spec.parser()
    bound = SETTINGS.output_parser_max_held_chars
    assert p.max_held_chars == bound and p.tools.max_held_chars == bound and p.reasoning.max_held_chars == bound


def test_text_buffer_keeps_the_text_in_about_its_length():
    """The growing texts (``TextBuffer``) join pieces as they come: the text is exact, and some 300,000 characters
    appended 2-4 at a time (fresh strings, as deltas are) take well under twice their size in memory (a list of
    the deltas would keep one string object of ~50 bytes per delta: some 20 times it)."""
    import tracemalloc

    from inference.shared.markers import TextBuffer

    r = random.Random(1)
    source = filler(400_000)
    cuts, i = [], 0
    while i < 300_000:
        k = r.randint(2, 4)
        cuts.append((i, i + k))
        i += k
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        buf = TextBuffer()
        for a, b in cuts:
            buf.append(source[a:b])  # a new string object per delta
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    expected = source[:i]
    assert held < 2 * len(expected), (held, len(expected))
    assert len(buf) == len(expected) and buf.text() == expected and buf.text() is buf.text()
    buf.append("tail")
    assert buf.text() == expected + "tail" and len(buf) == len(expected) + 4
