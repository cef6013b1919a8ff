"""Reasoning and tool-call parsers fed real tokenizers' token streams (issue 16).

The markup text is encoded with the real Qwen3 / Llama 3 / DeepSeek-V3 tokenizers, decoded back one token at a
time through the platform's own incremental detokenizer (as the gateway feeds the parsers), and also split at
every character boundary; every chunking must give exactly the one-shot parse, and no marker character may
leak into ``content`` or ``reasoning``.
"""

from __future__ import annotations

import json

import pytest

from inference.api.chat_output import ChatOutputParser, resolve_parser_name
from inference.api.output_processor import IncrementalDetokenizer
from inference.reasoning import get_reasoning_parser
from inference.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, default_reasoning_parser
from inference.renderer.tokenizer_cache import get_tokenizer
from inference.tool_parsers import HermesToolParser, Llama3JsonToolParser, default_tool_parser
from inference.tool_parsers.forced import NamedToolParser, RequiredToolParser
from tests.renderer.tokdirs import tok_dir

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris", "note": "a } and a \\" and <tool_call in a string"}}'
TIME_MARKUP = TIME.replace("<tool_call in", "</tool_call> in")


def token_deltas(tok, text: str) -> list[str]:
    """The text deltas the gateway would feed: ``text`` encoded, then detokenized one token at a time."""
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    return deltas


def run(make, chunks: list[str]) -> tuple[dict, list]:
    """Feed ``chunks`` to a fresh parser; returns the message fields without ids and the ordered deltas."""
    p: ChatOutputParser = make()
    deltas = [p.push(c) for c in chunks] + [p.finish()]
    fields = p.message_fields()
    for call in fields["tool_calls"]:
        assert call.pop("id").startswith("chatcmpl-tool-")
    return fields, deltas


def all_chunkings(text: str):
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]


def check_equal_everywhere(make, tok, text: str) -> dict:
    expected, _ = run(make, [text])
    got, _ = run(make, token_deltas(tok, text))
    assert got == expected
    for chunks in all_chunkings(text):
        assert run(make, chunks)[0] == expected, chunks
    return expected


@pytest.fixture(scope="module")
def qwen3():
    return get_tokenizer(tok_dir("qwen3"))


@pytest.fixture(scope="module")
def llama3():
    return get_tokenizer(tok_dir("llama3_1"))


@pytest.fixture(scope="module")
def deepseek():
    return get_tokenizer(tok_dir("deepseek_v3"))


# ------------------------------------------------------------------------------------------------- hermes
def test_hermes_two_calls_with_text_and_reasoning_qwen3(qwen3):
    text = (f"<think>\nThe user wants weather and time.\n</think>\n\nLet me check.\n<tool_call>\n{WEATHER}\n"
            f"</tool_call>\n<tool_call>\n{TIME}\n</tool_call>")
    make = lambda: ChatOutputParser(Qwen3ReasoningParser(qwen3, [1, 2]), HermesToolParser())
    got = check_equal_everywhere(make, qwen3, text)
    assert got["reasoning"] == got["reasoning_content"] == "\nThe user wants weather and time.\n"
    assert got["content"] == "\n\nLet me check.\n\n"
    assert [c["function"]["name"] for c in got["tool_calls"]] == ["get_weather", "get_time"]
    assert json.loads(got["tool_calls"][1]["function"]["arguments"])["note"] == 'a } and a " and <tool_call in a string'
    assert got["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "unit": "celsius"}'


def test_hermes_close_marker_inside_a_string_ends_the_block_as_vllm(qwen3):
    # vLLM's regex is non-greedy to the first </tool_call>: a block cut there does not parse and stays content
    text = f"<tool_call>\n{TIME_MARKUP}\n</tool_call>"
    got = check_equal_everywhere(lambda: ChatOutputParser(None, HermesToolParser()), qwen3, text)
    assert got["tool_calls"] == [] and got["content"] == text


def test_hermes_only_calls_gives_null_content_and_no_markup_anywhere(qwen3):
    text = f"\n<tool_call>\n{WEATHER}\n</tool_call>\n"
    make = lambda: ChatOutputParser(None, HermesToolParser())
    got = check_equal_everywhere(make, qwen3, text)
    assert got["content"] is None and len(got["tool_calls"]) == 1
    for chunks in [token_deltas(qwen3, text), list(text)]:
        _, deltas = run(make, chunks)
        assert all("<" not in d.content and "tool_call" not in d.content for d in deltas)


def test_hermes_invalid_json_stays_content(qwen3):
    text = 'Hi <tool_call>\n{"name": "f", "arguments": {oops}}\n</tool_call> bye'
    got = check_equal_everywhere(lambda: ChatOutputParser(None, HermesToolParser()), qwen3, text)
    assert got == {"content": text, "tool_calls": []}


def test_hermes_unclosed_last_block_is_a_call_when_it_parses(qwen3):
    got = check_equal_everywhere(lambda: ChatOutputParser(None, HermesToolParser()), qwen3,
                                 f"<tool_call>\n{WEATHER}\n")
    assert len(got["tool_calls"]) == 1 and got["content"] is None
    cut = '<tool_call>\n{"name": "get_wea'
    assert check_equal_everywhere(lambda: ChatOutputParser(None, HermesToolParser()), qwen3, cut)["content"] == cut


def test_parallel_tool_calls_false_keeps_the_first(qwen3):
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{WEATHER}\n</tool_call>"
    got = check_equal_everywhere(lambda: ChatOutputParser(None, HermesToolParser(), parallel_tool_calls=False),
                                 qwen3, text)
    assert len(got["tool_calls"]) == 1 and got["content"] is None


def test_text_that_only_resembles_markup_is_content(qwen3):
    text = "a <tool_c b <tool_callx> c </tool_call> <"
    got = check_equal_everywhere(lambda: ChatOutputParser(None, HermesToolParser()), qwen3, text)
    assert got == {"content": text, "tool_calls": []}


# ------------------------------------------------------------------------------------------------- llama
@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", " \n"])
def test_llama3_json_calls(llama3, prefix):
    text = prefix + ('{"name": "get_weather", "parameters": {"city": "Paris", "q": "a } b"}}; '
                     '{"name": "get_time", "parameters": {}}')
    got = check_equal_everywhere(lambda: ChatOutputParser(None, Llama3JsonToolParser()), llama3, text)
    assert [c["function"]["name"] for c in got["tool_calls"]] == ["get_weather", "get_time"]
    assert json.loads(got["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "q": "a } b"}
    assert got["content"] is None


def test_llama3_json_plain_answers_and_non_calls_are_content(llama3):
    for text in ["The weather is fine.", '{"answer": 42}', '{"name": "x"} trailing', 'Use {"name": "f"}']:
        got = check_equal_everywhere(lambda: ChatOutputParser(None, Llama3JsonToolParser()), llama3, text)
        assert got == {"content": text, "tool_calls": []}, text


def test_llama3_json_text_after_a_call_is_content(llama3):
    text = '{"name": "f", "parameters": {"a": 1}} and then words'
    got = check_equal_everywhere(lambda: ChatOutputParser(None, Llama3JsonToolParser()), llama3, text)
    assert got["content"] == " and then words" and got["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'


# ------------------------------------------------------------------------------------------------- reasoning
@pytest.mark.parametrize("prompt", ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"])
def test_qwen3_reasoning_from_the_output(qwen3, prompt):
    ids = qwen3.encode(prompt, add_special_tokens=False)
    make = lambda: ChatOutputParser(Qwen3ReasoningParser(qwen3, ids), None)
    got = check_equal_everywhere(make, qwen3, "<think>\nstep 1 < step 2 </thin\n</think>\n\nThe answer.")
    assert got["reasoning"] == "\nstep 1 < step 2 </thin\n" and got["content"] == "\n\nThe answer."
    plain = check_equal_everywhere(make, qwen3, "Just an answer </think> here")
    assert plain["reasoning"] is None and plain["content"] == "Just an answer </think> here"
    cut = check_equal_everywhere(make, qwen3, "<think>\nnever ends")
    assert cut["reasoning"] == "\nnever ends" and cut["content"] is None


def test_qwen3_prompt_decides_open_closed(qwen3):
    base = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    open_ids = qwen3.encode(base + "<think>\n", add_special_tokens=False)
    closed_ids = qwen3.encode(base + "<think>\n\n</think>\n\n", add_special_tokens=False)
    opened = check_equal_everywhere(lambda: ChatOutputParser(Qwen3ReasoningParser(qwen3, open_ids), None), qwen3,
                                    "thinking here\n</think>\n\nanswer")
    assert opened["reasoning"] == "thinking here\n" and opened["content"] == "\n\nanswer"
    closed = check_equal_everywhere(lambda: ChatOutputParser(Qwen3ReasoningParser(qwen3, closed_ids), None), qwen3,
                                    "<think>x</think>answer")
    assert closed["reasoning"] is None and closed["content"] == "<think>x</think>answer"
    # enable_thinking false with a template that did not close the block: still all content
    off = Qwen3ReasoningParser(qwen3, qwen3.encode(base, add_special_tokens=False), {"enable_thinking": False})
    assert not off.thinking and off.end_token_ids == []
    # a history with a closed think block followed by more turns is not "closed at the end"
    hist = qwen3.encode("<|im_start|>assistant\n<think>\nold\n</think>\n\nold answer<|im_end|>\n" + base,
                        add_special_tokens=False)
    assert Qwen3ReasoningParser(qwen3, hist).thinking


def test_reasoning_tokens_count_up_to_and_including_the_end_marker(qwen3):
    out = "<think>\nabc def\n</think>\n\nanswer here"
    ids = qwen3.encode(out, add_special_tokens=False)
    p = ChatOutputParser(Qwen3ReasoningParser(qwen3, [1]), None)
    for d in token_deltas(qwen3, out):
        p.push(d)
    p.finish()
    assert p.reasoning_tokens(ids) == ids.index(qwen3.token_to_id("</think>")) + 1
    q = ChatOutputParser(Qwen3ReasoningParser(qwen3, [1]), None)
    q.push("plain")
    q.finish()
    assert q.reasoning_tokens(qwen3.encode("plain", add_special_tokens=False)) == 0


def test_deepseek_r1_without_opening_tag_and_multi_token_markers(deepseek, qwen3):
    # DeepSeek-V3's vocabulary has no <think> token: the markers arrive split over several tokens
    assert deepseek.token_to_id("</think>") is None
    make = lambda: ChatOutputParser(DeepSeekR1ReasoningParser(deepseek, [0]), None)
    got = check_equal_everywhere(make, deepseek, "Let me think.\n</think>\n\nFinal.")
    assert got["reasoning"] == "Let me think.\n" and got["content"] == "\n\nFinal."
    with_tag = check_equal_everywhere(make, deepseek, "<think>\nA\n</think>B")
    assert with_tag["reasoning"] == "\nA\n" and with_tag["content"] == "B"
    p = make()
    deltas = [p.push(d) for d in token_deltas(deepseek, "Let me think.\n</think>\n\nFinal.")] + [p.finish()]
    assert not any("<" in d.reasoning or "<" in d.content for d in deltas)


# ------------------------------------------------------------------------------------------------- forced
def test_required_and_named_read_the_constrained_json(qwen3):
    arr = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    got = check_equal_everywhere(lambda: ChatOutputParser(None, RequiredToolParser()), qwen3, arr)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    named = check_equal_everywhere(lambda: ChatOutputParser(None, NamedToolParser("get_weather"), named_tool=True),
                                   qwen3, '{"city": "Paris"}')
    assert named["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    cut = check_equal_everywhere(lambda: ChatOutputParser(None, RequiredToolParser()), qwen3, '[{"name": "get_w')
    assert cut == {"content": '[{"name": "get_w', "tool_calls": []}


def test_finish_reason_rules():
    p = ChatOutputParser(None, HermesToolParser())
    p.push(f"<tool_call>{WEATHER}</tool_call>")
    p.finish()
    assert p.finish_reason("stop") == "tool_calls" and p.finish_reason("length") == "length"
    n = ChatOutputParser(None, NamedToolParser("f"), named_tool=True)
    n.push("{}")
    n.finish()
    assert n.calls and n.finish_reason("stop") == "stop"


# ------------------------------------------------------------------------------------------------- defaults
def test_auto_defaults_from_real_templates(qwen3, llama3, deepseek):
    assert default_reasoning_parser(qwen3.chat_template) == "qwen3"
    assert default_tool_parser(qwen3.chat_template) == "hermes"
    assert default_reasoning_parser(llama3.chat_template) is None
    assert default_tool_parser('{{ "<|python_tag|>" }}') == "llama3_json"
    assert default_reasoning_parser("<｜Assistant｜><think>\n") == "deepseek_r1"
    assert resolve_parser_name("auto", qwen3.chat_template, kind="tool") == "hermes"
    assert resolve_parser_name("none", qwen3.chat_template, kind="tool") is None
    assert resolve_parser_name("llama3_json", None, kind="tool") == "llama3_json"
    assert resolve_parser_name("gone", None, kind="reasoning") is None
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
