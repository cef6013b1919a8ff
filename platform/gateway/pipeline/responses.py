"""Step 10 (docs/ARCHITECTURE.md §2): response bodies and SSE chunks. Every check has run before ``start_sse``;
after it, an engine failure is an in-band error event (``GatewayConsumer.send_sse_error``)."""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from gateway.http import GatewayConsumer
from gateway.pipeline.engine import GenerationRun
from gateway.pipeline.usage import Usage, usage_dict
from inference.api.output_processor import ChoiceDelta, ChoiceState

JsonObject = dict[str, object]
"""An OpenAI JSON object the gateway writes (a response body, a chunk, a choice): built here, sent as JSON."""
# choice_of(delta, state) -> one chunk's choice, several (one chunk each, in order), or None (nothing to send)
ChoiceOf = Callable[[ChoiceDelta, ChoiceState], "JsonObject | list[JsonObject] | None"]
# envelope(choices, usage) -> one response object or chunk
Envelope = Callable[[list[JsonObject], "Usage | None"], JsonObject]


def run_usage(run: GenerationRun, reasoning_tokens: int | None = None) -> Usage:
    """The OpenAI ``usage`` object of a finished run (``reasoning_tokens``: see ``usage_dict``)."""
    return usage_dict(run.prompt_tokens, run.completion_tokens, run.num_cached_tokens, reasoning_tokens)


async def complete(run: GenerationRun) -> None:
    """Wait for every choice to finish; ``ApiError`` 503 ``engine_error`` (``Retry-After: 1``) when one failed."""
    async for _ in run.deltas():
        pass
    run.raise_for_engine_error(retry_after=True)


async def stream(consumer: GatewayConsumer, run: GenerationRun, envelope: Envelope, choice_of: ChoiceOf, *,
                 include_usage: bool, first_events: Iterable[JsonObject] = (),
                 usage_of: Callable[[GenerationRun], Usage] = run_usage) -> None:
    """Stream ``run`` as SSE: 200 + headers, ``first_events``, then one chunk ``envelope([choice], None)`` per
    choice that ``choice_of(delta, state)`` gives for a delta (a list: one chunk each; ``None``: nothing to send
    yet), the usage chunk ``envelope([], usage_of(run))`` when ``include_usage``, and ``[DONE]``. An engine
    failure ends the stream with an in-band error (raised as ``ApiError``)."""
    await consumer.start_sse()
    for event in first_events:
        await consumer.send_event(event)
    async for d in run.deltas():
        state = run.choices[d.index]
        if state.finish_reason == "error":
            break
        choice = choice_of(d, state)
        for one in ([choice] if isinstance(choice, dict) else choice or []):
            await consumer.send_event(envelope([one], None))
    run.raise_for_engine_error(retry_after=False)
    if include_usage:
        await consumer.send_event(envelope([], usage_of(run)))
    await consumer.end_sse()


class StreamUsage(Protocol):
    """The ``stream_options`` fields a stream's usage follows (``inference.protocol.openai.StreamOptions``)."""

    include_usage: bool | None
    continuous_usage_stats: bool | None


def usage_options(options: StreamUsage | None) -> tuple[bool, bool]:
    """``(include_usage, continuous)`` of a request's ``stream_options``: the final usage chunk, and a running
    usage on every chunk (``continuous_usage_stats``; as vLLM, only together with ``include_usage``)."""
    include = bool(options and options.include_usage)
    return include, include and bool(options and options.continuous_usage_stats)


def chunk_envelope(obj: str, external_id: str, created: int, run: GenerationRun, include_usage: bool,
                   continuous: bool = False) -> Envelope:
    """The ``envelope(choices, usage)`` of ``stream`` for OpenAI's streamed objects (``obj``:
    ``"chat.completion.chunk"`` or ``"text_completion"``): ``{"id", "object", "created", "model", "choices"}``,
    plus ``usage`` (``None`` but on the last chunk) when the client asked for ``stream_options.include_usage``.
    With ``continuous`` (``usage_options``) every other chunk has the usage so far instead of ``None``:
    ``prompt_tokens``, ``completion_tokens`` of all choices up to that chunk, ``total_tokens``."""

    def envelope(choices: list[JsonObject], usage: Usage | None) -> JsonObject:
        body: JsonObject = {"id": external_id, "object": obj, "created": created, "model": run.model.served_model_name,
                            "choices": choices}
        if include_usage:
            body["usage"] = usage_dict(run.prompt_tokens, run.completion_tokens) if usage is None and continuous \
                else usage
        return body

    return envelope


class LogprobCursor:
    """Per choice, how many of its tokens' logprobs were already sent (streams send each token's once)."""

    def __init__(self, run: GenerationRun):
        self._seen = {c.index: 0 for c in run.choices}

    def take(self, state: ChoiceState) -> tuple[list[int], list[object]]:
        """The ids and logprob entries of ``state`` not sent yet (the engine's, passed on to ``gateway.logprobs``);
        marks them sent."""
        start, self._seen[state.index] = self._seen[state.index], len(state.token_ids)
        return state.token_ids[start:], state.logprobs[start:]
