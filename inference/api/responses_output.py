"""Responses API output (pure): the parsed chat output of a run (``inference.api.chat_output``: reasoning, answer
text and tool calls) → output items, the ``response`` object and the stream's semantic events.

One ``ResponseBuilder`` per response takes the choice's ``ChatDelta`` s as they come and keeps the output items; the
stream sends the events it returns, the non-streamed body and the stored response read its ``output`` at the end,
so both are built by the same code from the same deltas.

Items, in the order the model wrote them: ``reasoning`` (``content: [{"type": "reasoning_text"}]``), ``message``
(``output_text``), one ``function_call`` per call (``call_id`` ``call_<24 hex>``). A new kind of text closes the
item before it (reasoning, then answer text; text after a call opens a new message). A response that wrote
nothing at all gets one empty message, as OpenAI's does.

Events (``openai/types/responses/response_stream_event.py``), each with ``sequence_number`` counted from 0 without
a gap: ``response.created``, ``response.in_progress``; per item ``response.output_item.added``, for a message or
reasoning ``response.content_part.added``, the deltas (``response.output_text.delta``,
``response.reasoning_text.delta``, ``response.function_call_arguments.delta``), their ``.done``,
``response.content_part.done``, ``response.output_item.done``; then one of ``response.completed``,
``response.incomplete`` (``incomplete_details.reason``: ``max_output_tokens``) or ``response.failed`` (after an
``error`` event). No ``[DONE]``.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from inference.api.chat_output import ChatDelta
from inference.protocol.responses import (EV_ARGS_DELTA, EV_ARGS_DONE, EV_COMPLETED, EV_ERROR, EV_FAILED,
                                          EV_INCOMPLETE, EV_ITEM_ADDED, EV_ITEM_DONE, EV_PART_ADDED,
                                          EV_PART_DONE, EV_REASONING_DELTA, EV_REASONING_DONE, EV_TEXT_DELTA,
                                          EV_TEXT_DONE, STATUS_COMPLETED, STATUS_FAILED, STATUS_INCOMPLETE,
                                          STATUS_IN_PROGRESS, ResponsesRequest, TextFormatJsonObject,
                                          TextFormatJsonSchema, ToolChoiceAllowed, ToolChoiceFunction, Usage)

Event = dict[str, Any]
"""One stream event (``type``, ``sequence_number`` and its fields), sent as ``event: <type>`` + ``data: <json>``."""
Item = dict[str, Any]
"""One output item object."""
Logprob = dict[str, Any]
"""One token's ``{"token", "logprob", "bytes", "top_logprobs"}`` of an ``output_text``."""


def new_response_id() -> str:
    """``resp_<48 hex>``."""
    return f"resp_{secrets.token_hex(24)}"


def new_item_id(prefix: str) -> str:
    """``<prefix>_<48 hex>``: ``msg``, ``rs``, ``fc`` (output items) or ``in`` (an input item sent without an id)."""
    return f"{prefix}_{secrets.token_hex(24)}"


def new_call_id() -> str:
    """A function call's ``call_id``: ``call_<24 hex>``."""
    return f"call_{secrets.token_hex(12)}"


class ResponseBuilder:
    """Output items and stream events of one response (module docstring). ``seq`` is the next event's
    ``sequence_number`` (a resumed stream's builder may start after 0)."""

    def __init__(self, *, seq: int = 0) -> None:
        self.seq = seq
        self.output: list[Item] = []
        self._open: Item | None = None  # the reasoning or message item text is flowing into
        self._chunks: list[str] = []
        self._logprobs: list[Logprob] = []

    def event(self, kind: str, **fields: Any) -> Event:
        """The next event of type ``kind`` (its ``sequence_number`` taken)."""
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def lifecycle(self, kind: str, response: Mapping[str, Any]) -> Event:
        """``response.created`` / ``queued`` / ``in_progress`` / ``completed`` / ``incomplete`` / ``failed`` with
        ``response``."""
        return self.event(kind, response=response)

    def error(self, message: str, code: str | None, param: str | None = None) -> Event:
        """The ``error`` event of a failure after the stream started (then ``response.failed``)."""
        return self.event(EV_ERROR, code=code, message=message, param=param)

    def push(self, delta: ChatDelta, logprobs: list[Logprob] | None = None) -> list[Event]:
        """The events of one parsed delta: reasoning text, answer text (``logprobs``: its tokens'), then each
        completed call."""
        events: list[Event] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning, None)
        if delta.content:
            events += self._text("message", delta.content, logprobs)
        for call in delta.calls:
            events += self._close(STATUS_COMPLETED)
            events += self._call(call.call.name, call.call.arguments)
        return events

    def finish(self, status: str = STATUS_COMPLETED) -> list[Event]:
        """Close the open item (``status``: ``completed``, or ``incomplete`` when the response is); an empty
        message when nothing was written at all."""
        events = self._close(STATUS_INCOMPLETE if status == STATUS_INCOMPLETE else STATUS_COMPLETED)
        if not self.output and status != STATUS_FAILED:
            events += self._open_item("message")
            events += self._close(STATUS_INCOMPLETE if status == STATUS_INCOMPLETE else STATUS_COMPLETED)
        return events

    def _text(self, kind: str, text: str, logprobs: list[Logprob] | None) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close(STATUS_COMPLETED)
            events += self._open_item(kind)
        item = self._open
        assert item is not None
        self._chunks.append(text)
        index = len(self.output) - 1
        if kind == "message":
            self._logprobs += logprobs or []
            events.append(self.event(EV_TEXT_DELTA, item_id=item["id"], output_index=index, content_index=0,
                                     delta=text, logprobs=logprobs or []))
        else:
            events.append(self.event(EV_REASONING_DELTA, item_id=item["id"], output_index=index, content_index=0,
                                     delta=text))
        return events

    def _open_item(self, kind: str) -> list[Event]:
        part: Item
        if kind == "message":
            item: Item = {"id": new_item_id("msg"), "type": "message", "role": "assistant",
                          "status": STATUS_IN_PROGRESS, "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "status": STATUS_IN_PROGRESS}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        self._open, self._chunks, self._logprobs = item, [], []
        index = len(self.output) - 1
        return [self.event(EV_ITEM_ADDED, output_index=index, item=dict(item, content=[])),
                self.event(EV_PART_ADDED, item_id=item["id"], output_index=index, content_index=0, part=part)]

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        self._open = None
        text = "".join(self._chunks)
        index = len(self.output) - 1
        if item["type"] == "message":
            part: Item = {"type": "output_text", "text": text, "annotations": [], "logprobs": self._logprobs}
            done = self.event(EV_TEXT_DONE, item_id=item["id"], output_index=index, content_index=0, text=text,
                              logprobs=self._logprobs)
        else:
            part = {"type": "reasoning_text", "text": text}
            done = self.event(EV_REASONING_DONE, item_id=item["id"], output_index=index, content_index=0, text=text)
        item["content"] = [part]
        item["status"] = status
        return [done, self.event(EV_PART_DONE, item_id=item["id"], output_index=index, content_index=0, part=part),
                self.event(EV_ITEM_DONE, output_index=index, item=item)]

    def _call(self, name: str, arguments: str) -> list[Event]:
        item: Item = {"id": new_item_id("fc"), "type": "function_call", "call_id": new_call_id(), "name": name,
                      "arguments": "", "status": STATUS_IN_PROGRESS}
        self.output.append(item)
        index = len(self.output) - 1
        events = [self.event(EV_ITEM_ADDED, output_index=index, item=dict(item))]
        if arguments:
            events.append(self.event(EV_ARGS_DELTA, item_id=item["id"], output_index=index, delta=arguments))
        events.append(self.event(EV_ARGS_DONE, item_id=item["id"], output_index=index, arguments=arguments))
        item["arguments"], item["status"] = arguments, STATUS_COMPLETED
        events.append(self.event(EV_ITEM_DONE, output_index=index, item=item))
        return events


def terminal_event_type(status: str) -> str:
    """The stream's last event type for a final ``status``."""
    return {STATUS_COMPLETED: EV_COMPLETED, STATUS_INCOMPLETE: EV_INCOMPLETE}.get(status, EV_FAILED)


def final_status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """``(status, incomplete_details)`` of a response whose choice ended with the engine's ``finish_reason``: an
    answer cut by the output cap (``length``) is ``incomplete`` with reason ``max_output_tokens``."""
    if finish_reason == "length":
        return STATUS_INCOMPLETE, {"reason": "max_output_tokens"}
    return STATUS_COMPLETED, None


def text_param(req: ResponsesRequest) -> dict[str, Any]:
    """The ``text`` object a response echoes (``{"format": {"type": "text"}}`` when none was given)."""
    fmt = req.text.format if req.text is not None else None
    out: dict[str, Any]
    if isinstance(fmt, TextFormatJsonSchema):
        out = {"type": "json_schema", "name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict,
               **({"description": fmt.description} if fmt.description is not None else {})}
    elif isinstance(fmt, TextFormatJsonObject):
        out = {"type": "json_object"}
    else:
        out = {"type": "text"}
    text: dict[str, Any] = {"format": out}
    if req.text is not None and req.text.verbosity is not None:
        text["verbosity"] = req.text.verbosity
    return text


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if isinstance(choice, (ToolChoiceFunction, ToolChoiceAllowed)):
        return choice.model_dump()
    return choice or "auto"


def request_echo(req: ResponsesRequest) -> dict[str, Any]:
    """The request parameters a ``response`` object repeats (computed once per request, stored with it)."""
    reasoning = req.reasoning
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "reasoning": {"effort": reasoning.effort, "summary": reasoning.summary} if reasoning is not None else None,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": text_param(req),
        "tool_choice": _tool_choice(req),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "top_logprobs": req.top_logprobs or 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "user": req.user,
        "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
        "service_tier": "default",
    }


def response_object(*, response_id: str, created_at: float, model: str, status: str, echo: Mapping[str, Any],
                    output: list[Item], usage: Usage | None, previous_response_id: str | None,
                    metadata: Mapping[str, str] | None, background: bool, store: bool,
                    completed_at: float | None = None, error: Mapping[str, Any] | None = None,
                    incomplete_details: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``response`` object (``openai/types/responses/response.py``)."""
    return {
        "id": response_id, "object": "response", "created_at": int(created_at), "status": status,
        "background": background, "completed_at": int(completed_at) if completed_at is not None else None,
        "error": dict(error) if error is not None else None,
        "incomplete_details": dict(incomplete_details) if incomplete_details is not None else None,
        "model": model, "output": output, "previous_response_id": previous_response_id,
        "metadata": dict(metadata or {}), "store": store, "usage": usage, **echo,
    }
