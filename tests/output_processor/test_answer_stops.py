"""Stop strings apply to the answer only, never to the reasoning (issue 41; vLLM and SGLang fixed the same bug):
``AnswerStopChecker`` / ``stop_checker`` and ``RequestState`` with a reasoning parser (inference/api/output_processor.py),
over the real Qwen3 and DeepSeek-V3 tokenizers and their reasoning parsers."""

from __future__ import annotations

import pytest

from inference.api.output_processor import AnswerStopChecker, OutputProcessor, RequestState, StopChecker, stop_checker
from inference.protocol.engine import EngineCoreOutput
from inference.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from inference.renderer.tokenizer_cache import get_tokenizer
from tests.renderer.tokdirs import tok_dir

PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen3():
    return get_tokenizer(tok_dir("qwen3"))


@pytest.fixture(scope="module")
def deepseek():
    return get_tokenizer(tok_dir("deepseek_v3"))


def chunkings(text: str):
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]


def feed(make, chunks: list[str]) -> tuple[str, str | None]:
    """Push ``chunks`` into a fresh checker and flush it: (emitted text, matched stop)."""
    checker = make()
    out, matched = [], None
    for chunk in chunks:
        emit, matched = checker.push(chunk)
        out.append(emit)
        if matched is not None:
            return "".join(out), matched
    tail, matched = checker.flush()
    return "".join(out) + tail, matched


def same_everywhere(make, text: str) -> tuple[str, str | None]:
    """The result of feeding ``text`` whole, checked equal for every chunking."""
    expected = feed(make, [text])
    for chunks in chunkings(text):
        assert feed(make, chunks) == expected, chunks
    return expected


def run_state(tok, parser_of, text: str, *, stop, include=False, n=1, finish="stop", one_by_one=True):
    """``RequestState`` over ``text`` encoded, ``n`` children fed the same tokens; returns the state."""
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    state = RequestState(tok, prompt, [f"r-{i}" for i in range(n)], stop=stop, include_stop_str_in_output=include,
                         skip_special_tokens=True, arrival_time=0.0, reasoning=lambda: parser_of(tok, prompt))
    proc = OutputProcessor(state)
    ids = tok.encode(text, add_special_tokens=False)
    batches = [[t] for t in ids] if one_by_one else [ids]
    aborts = []
    for k, batch in enumerate(batches):
        last = k == len(batches) - 1
        outs = [EngineCoreOutput(f"r-{i}", batch, finish_reason=finish if last else None) for i in range(n)]
        aborts += proc.process_outputs(outs).reqs_to_abort
    state.aborts = aborts
    return state


@pytest.mark.parametrize("one_by_one", [True, False])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_in_the_reasoning_is_not_matched_in_the_answer_it_is(qwen3, include, one_by_one):
    text = "<think>\nalpha STOP beta\n</think>\n\nanswer STOP tail"
    state = run_state(qwen3, Qwen3ReasoningParser, text, stop=["STOP"], include=include, n=2, one_by_one=one_by_one)
    want = "<think>\nalpha STOP beta\n</think>\n\nanswer " + ("STOP" if include else "")
    for c in state.choices:
        assert (c.text, c.finish_reason, c.stop_reason) == (want, "stop", "STOP")
    if one_by_one:  # matched before the engine's end: both children are aborted
        assert state.aborts == ["r-0", "r-1"]


def test_a_stop_string_only_in_the_reasoning_or_across_its_end_marker_never_matches(qwen3):
    text = "<think>\nalpha STOP\n</think>\n\nall done"
    state = run_state(qwen3, Qwen3ReasoningParser, text, stop=["STOP", "\n</think>", "</think>\n\nall"],
                      finish="length")
    c = state.choices[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (text, "length", None)


def test_reasoning_that_never_ends_is_never_cut(qwen3):
    state = run_state(qwen3, Qwen3ReasoningParser, "<think>\nalpha STOP beta", stop=["STOP"], finish="length")
    assert (state.choices[0].text, state.choices[0].finish_reason) == ("<think>\nalpha STOP beta", "length")


def test_any_chunking_gives_the_same_cut(qwen3, deepseek):
    ids = qwen3.encode(PROMPT, add_special_tokens=False)
    qwen = lambda: stop_checker(["STOP", "ok"], False, Qwen3ReasoningParser(qwen3, ids))
    assert same_everywhere(qwen, "<think>\nok STOP\n</think>\n\nfine STOP x") == ("<think>\nok STOP\n</think>\n\nfine ",
                                                                                 "STOP")
    # without a think block the whole output is the answer: a stop in the held leading whitespace and a possible
    # start of <think> is still found from the first character
    assert same_everywhere(qwen, "\n\n<thiok") == ("\n\n<thi", "ok")
    assert same_everywhere(lambda: stop_checker(["\n<thi"], True, Qwen3ReasoningParser(qwen3, ids)),
                           "\n\n<thi more") == ("\n\n<thi", "\n<thi")
    # DeepSeek-R1: reasoning without an opening tag, markers split over several tokens
    r1 = lambda: stop_checker(["STOP"], False, DeepSeekR1ReasoningParser(deepseek, [0]))
    assert same_everywhere(r1, "alpha STOP</think>answer STOP") == ("alpha STOP</think>answer ", "STOP")
    assert same_everywhere(r1, "  <think>x STOP</think>y") == ("  <think>x STOP</think>y", None)


def test_the_prompt_decides_where_stop_strings_start(qwen3):
    open_ids = qwen3.encode(PROMPT + "<think>\n", add_special_tokens=False)
    opened = lambda: stop_checker(["STOP"], False, Qwen3ReasoningParser(qwen3, open_ids))
    assert same_everywhere(opened, "a STOP\n</think>\n\nok STOP x") == ("a STOP\n</think>\n\nok ", "STOP")
    # a closed block, or enable_thinking false: no reasoning, the plain checker from the first character
    closed = qwen3.encode(PROMPT + "<think>\n\n</think>\n\n", add_special_tokens=False)
    plain = qwen3.encode(PROMPT, add_special_tokens=False)
    for parser in (Qwen3ReasoningParser(qwen3, closed), Qwen3ReasoningParser(qwen3, plain, {"enable_thinking": False})):
        checker = stop_checker(["STOP"], False, parser)
        assert type(checker) is StopChecker and checker.push("a STOP") == ("a ", "STOP")
    # no stop strings, or no reasoning parser: the plain checker
    assert type(stop_checker(None, False, Qwen3ReasoningParser(qwen3, plain))) is StopChecker
    assert type(stop_checker(["x"], False, None)) is StopChecker
    assert type(stop_checker(["x"], False, Qwen3ReasoningParser(qwen3, plain))) is AnswerStopChecker
