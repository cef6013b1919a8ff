"""Chat Completions gaps of issue 41, end to end with the official ``openai`` client on the shared live platform:
stop strings apply to the answer only (never to the reasoning), ``stream_options.continuous_usage_stats``,
chat ``echo`` of the final assistant message, and a forced tool declared without ``parameters``.

The demo model has random weights: ``structured_outputs.regex`` (fixture ``forced``) makes it write exact text."""

from __future__ import annotations

import pytest

from tests.agent_output_live.conftest import MODEL
from tests.agent_output_live.test_agent_output_live import MSGS, lit

REASONED = "<think>\nalpha STOP beta\n</think>\n\nanswer STOP tail"


def by_choice(chunks) -> dict[int, dict]:
    """A stream reassembled per choice index: content, reasoning, finish reason and stop reason."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            entry = out.setdefault(choice.index, {"content": "", "reasoning": "", "finish": None, "stop_reason": None})
            delta = choice.delta.model_dump(exclude_none=True)
            entry["content"] += delta.get("content") or ""
            entry["reasoning"] += delta.get("reasoning") or ""
            if choice.finish_reason:
                entry["finish"] = choice.finish_reason
                entry["stop_reason"] = (choice.model_extra or {}).get("stop_reason")
    return out


# ------------------------------------------------------------------------------------------ stop strings vs reasoning
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_inside_the_reasoning_does_not_end_the_generation(forced, include):
    """"STOP" in the reasoning is reasoning; the answer is cut at its own "STOP" (kept with
    ``include_stop_str_in_output``), streamed and not, for every choice of n=2."""
    kw = dict(messages=MSGS, max_tokens=120, temperature=1.0, seed=5, n=2, stop=["STOP"],
              extra_body={"include_stop_str_in_output": include})
    answer = "\n\nanswer STOP" if include else "\n\nanswer "
    full = forced(lit(REASONED), **kw)
    assert len(full.choices) == 2
    for choice in full.choices:
        extra = choice.message.model_extra or {}
        assert extra.get("reasoning") == "\nalpha STOP beta\n"
        assert choice.message.content == answer
        assert choice.finish_reason == "stop" and choice.model_extra.get("stop_reason") == "STOP"
    streamed = by_choice(forced(lit(REASONED), stream=True, **kw))
    assert set(streamed) == {0, 1}
    for entry in streamed.values():
        assert entry == {"content": answer, "reasoning": "\nalpha STOP beta\n", "finish": "stop",
                         "stop_reason": "STOP"}


def test_a_stop_string_only_in_the_reasoning_lets_the_answer_finish(forced):
    full = forced(lit("<think>\nalpha STOP\n</think>\n\nall done"), messages=MSGS, max_tokens=120, temperature=1.0,
                  seed=5, stop=["STOP", "\n</think>"])
    choice = full.choices[0]
    assert (choice.message.model_extra or {}).get("reasoning") == "\nalpha STOP\n"
    assert choice.message.content == "\n\nall done" and choice.finish_reason == "stop"


def test_without_reasoning_a_stop_string_still_applies_from_the_first_token(forced):
    full = forced(lit("alpha STOP beta"), messages=MSGS, max_tokens=60, temperature=1.0, seed=5, stop=["STOP"],
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert full.choices[0].message.content == "alpha " and full.choices[0].finish_reason == "stop"


# ------------------------------------------------------------------------------------------ continuous usage stats
def _check_continuous(chunks, prompt_tokens_of_final: int, completion_tokens_of_final: int) -> None:
    assert all(c.usage is not None for c in chunks), "every chunk carries usage"
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == completion_tokens_of_final
    for c in chunks:
        assert c.usage.prompt_tokens == prompt_tokens_of_final
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    # the text chunks count their own tokens: the last choice chunk already has the final count
    last_choice_chunk = [c for c in chunks if c.choices][-1]
    assert last_choice_chunk.usage.completion_tokens == completion_tokens_of_final


@pytest.mark.parametrize("n", [1, 2])
def test_chat_continuous_usage_stats_put_usage_on_every_chunk(client, n):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=12, temperature=1.0, seed=1, n=n, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 12 * n
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].usage.completion_tokens == 0
    _check_continuous(chunks, final.usage.prompt_tokens, final.usage.completion_tokens)
    # without the flag, only the final chunk has usage (unchanged)
    plain = list(client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage is not None


def test_completions_continuous_usage_stats_put_usage_on_every_chunk(client):
    for echo in (False, True):
        chunks = list(client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True, echo=echo,
            stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
        final = chunks[-1]
        assert final.choices == [] and final.usage.completion_tokens == 10
        _check_continuous(chunks, final.usage.prompt_tokens, 10)
        # the echoed prompt comes before any token; without echo the first chunk holds the first token
        assert (chunks[0].usage.completion_tokens == 0) is echo


# ------------------------------------------------------------------------------------------ echo
CONTINUED = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]


@pytest.mark.parametrize("content", ["My favourite is", [{"type": "text", "text": "My favourite"},
                                                         {"type": "text", "text": "is"}]])
def test_chat_echo_with_continue_final_message_echoes_the_assistant_prefix(client, content):
    msgs = [CONTINUED[0], {"role": "assistant", "content": content}]
    prefix = content if isinstance(content, str) else "My favourite\nis"
    kw = dict(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
              extra_body={"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True,
                          "chat_template_kwargs": {"enable_thinking": False}})
    plain = client.chat.completions.create(**kw)
    echoed = client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "echo": True}})
    assert echoed.choices[0].message.content == prefix + (plain.choices[0].message.content or "")
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    chunks = list(client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "echo": True}},
                                                 stream=True))
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert contents[0] == prefix
    assert "".join(contents) == echoed.choices[0].message.content


def test_chat_echo_without_a_final_assistant_message_echoes_nothing(client):
    kw = dict(model=MODEL, messages=MSGS, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**kw)
    echoed = client.chat.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "echo": True}})
    assert echoed.choices[0].message.content == plain.choices[0].message.content


# ------------------------------------------------------------------------------------------ tools without parameters
NO_PARAMS = {"type": "function", "function": {"name": "get_time", "description": "The current time"}}


@pytest.mark.usefixtures("forced")
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_without_parameters_is_called_with_an_empty_object(client, tool_choice, stream):
    """Only ``{}`` is admitted, so the call closes at once (``parallel_tool_calls`` false: with it the random model
    may add further calls to the ``required`` array until ``max_tokens``, which is the model's choice)."""
    finish = "tool_calls" if tool_choice == "required" else "stop"
    for seed in range(4):
        kw = dict(model=MODEL, messages=MSGS, tools=[NO_PARAMS], tool_choice=tool_choice, max_tokens=60,
                  temperature=1.0, seed=seed, parallel_tool_calls=False)
        if stream:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            assert calls and calls[0].function.name == "get_time"
            assert "".join(tc.function.arguments or "" for tc in calls) == "{}"
            assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish]
        else:
            resp = client.chat.completions.create(**kw)
            calls = resp.choices[0].message.tool_calls or []
            assert [(c.function.name, c.function.arguments) for c in calls] == [("get_time", "{}")]
            assert resp.choices[0].finish_reason == finish and resp.usage.completion_tokens < 60
