"""Chat Completions gaps of issue 41, end to end with the official ``openai`` client on the shared live platform:
stop strings apply to the answer only (never to the reasoning), ``stream_options.continuous_usage_stats``,
chat ``echo`` of the final assistant message, and a forced tool declared without ``parameters``.

The demo model has random weights: ``structured_outputs.regex`` (fixture ``forced``) makes it write exact text."""

from __future__ import annotations

import pytest

from tests.agent_output_live.conftest import MODEL
from tests.agent_output_live.test_agent_output_live import MSGS

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
