"""Responses API input → the internal chat request (pure; docs/ARCHITECTURE.md §2: one pipeline, protocol adapters).

A Responses request (``inference.protocol.responses.ResponsesRequest``) becomes the ``ChatCompletionRequest`` every
generating step takes, so validation, limits, admission, rendering, parsing and usage are the chat route's own:

* ``instructions`` → a leading ``system`` message (the request's own only: a chain's earlier instructions are not
  carried over, as OpenAI says);
* the chain's stored items (``previous_response_id``: each earlier turn's input, then its output) and then this
  request's ``input`` → messages, in order:

  - ``message`` → a message of its role; ``input_text`` parts → text parts, ``input_image`` → ``image_url`` parts,
    an assistant's ``output_text``/``refusal`` parts → its text;
  - ``function_call`` → a ``tool_calls`` entry of an assistant message: the assistant message just before it when
    the item before was that message or another call (one turn's text and calls are one chat message), else a new
    one with ``content: null``;
  - ``function_call_output`` → a ``tool`` message (``tool_call_id`` = ``call_id``);
  - ``reasoning`` → the ``reasoning`` field of the next assistant message (dropped when none follows);
  - ``item_reference`` → the referenced stored item (looked up by the caller: ``references``);

* flat function tools → chat's ``{"type": "function", "function": {...}}``; ``tool_choice`` ``{"type":
  "function", "name"}`` → chat's named choice; ``allowed_tools`` → the tools cut to the allowed ones with its mode;
* ``text.format`` → ``response_format`` (not while ``tool_choice`` forces a call: that turn's output is the call, the
  format is the later answer's); ``max_output_tokens`` → ``max_completion_tokens``; ``reasoning.effort`` →
  ``chat_template_kwargs.reasoning_effort`` (``none`` also sets ``enable_thinking: false``); sampling fields as
  they are; ``include`` of ``message.output_text.logprobs`` → ``logprobs`` with ``top_logprobs``.

So a chain of Responses turns renders exactly the prompt of the same conversation sent whole to Chat Completions
(tests/responses/test_responses_input.py; the live test compares the prompt ids).

``truncation: "auto"`` drops the oldest turns until the prompt fits (``drop_oldest``, ``turns_to_drop``): a turn is
one message, except that an assistant message with calls goes together with the tool messages answering them; the
instructions and the newest turn are never dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inference.protocol.openai import ChatCompletionRequest, RequestValidationError, validate_request
from inference.protocol.responses import (FunctionCallItem, FunctionCallOutputItem, InputImage, InputItem, InputText,
                                          ItemReference, MessageItem, ReasoningItem, RefusalPart,
                                          ResponsesRequest,
                                          TextFormatJsonObject, TextFormatJsonSchema, ToolChoiceAllowed,
                                          ToolChoiceFunction, parse_input_item)

ChatMessage = dict[str, Any]
"""A chat message as ``ChatCompletionRequest.messages`` takes it (before validation)."""
INSTRUCTIONS = -1
"""``ChatConversion.origins`` entry of the message made from ``instructions``."""


@dataclass
class ChatConversion:
    """The chat messages of a conversation and, per message, the index of the item it came from in the combined
    item list (the chain's items, then this request's input; ``INSTRUCTIONS`` for the instructions' message)."""

    messages: list[ChatMessage] = field(default_factory=list)
    origins: list[int] = field(default_factory=list)


def stored_items(raw: Sequence[Mapping[str, Any]]) -> list[InputItem]:
    """Items as stored (earlier turns' input and output item objects) back as input items."""
    return [parse_input_item(i, dict(item)) for i, item in enumerate(raw)]


def resolve_references(items: Sequence[InputItem], references: Mapping[str, Mapping[str, Any]]) -> list[InputItem]:
    """``items`` with each ``item_reference`` replaced by the stored item it names (``references``: id → stored
    item); ``RequestValidationError`` (``input[i].id``) for an id not there (not the caller's, or deleted)."""
    out: list[InputItem] = []
    for i, item in enumerate(items):
        if isinstance(item, ItemReference):
            stored = references.get(item.id)
            if stored is None:
                raise RequestValidationError(f"input[{i}] references item {item.id!r}, which is not an item of any "
                                             "of your stored responses", f"input[{i}].id")
            resolved = parse_input_item(i, dict(stored))
            if isinstance(resolved, ItemReference):
                raise RequestValidationError(f"input[{i}] references another reference", f"input[{i}].id")
            out.append(resolved)
        else:
            out.append(item)
    return out


def _text_of(parts: Sequence[Any]) -> str:
    return "".join(str(p.refusal if isinstance(p, RefusalPart) else p.text) for p in parts)


def _user_content(item: MessageItem) -> str | list[dict[str, Any]]:
    if isinstance(item.content, str):
        return item.content
    if len(item.content) == 1 and isinstance(item.content[0], InputText):
        return item.content[0].text  # as a string: how it is stored (``stored_input_item``) renders like the string
    parts: list[dict[str, Any]] = []
    for part in item.content:
        if isinstance(part, InputText):
            parts.append({"type": "text", "text": part.text})
        elif isinstance(part, InputImage):
            url: dict[str, Any] = {"url": part.image_url}
            if part.detail in ("low", "high", "auto"):
                url["detail"] = part.detail
            parts.append({"type": "image_url", "image_url": url})
    return parts


def _reasoning_text(item: ReasoningItem) -> str:
    if item.content:
        return "".join(p.text for p in item.content)
    return "\n".join(s.text for s in item.summary)


def items_to_messages(items: Sequence[InputItem], instructions: str | None) -> ChatConversion:
    """The chat messages of ``items`` (module docstring), ``instructions`` first. ``item_reference`` s must have been
    resolved (``resolve_references``)."""
    conv = ChatConversion()
    if instructions:
        conv.messages.append({"role": "system", "content": instructions})
        conv.origins.append(INSTRUCTIONS)
    reasoning: str | None = None
    joinable = False  # the last message is an assistant's that a following call belongs to
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + _reasoning_text(item)
            continue
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if joinable:
                conv.messages[-1].setdefault("tool_calls", []).append(call)
                continue
            message: ChatMessage = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else _text_of(item.output)
            message = {"role": "tool", "tool_call_id": item.call_id, "content": output}
        elif isinstance(item, MessageItem):
            if item.role == "assistant":
                message = {"role": "assistant", "content": item.content if isinstance(item.content, str)
                           else _text_of(item.content)}
            else:
                message = {"role": item.role, "content": _user_content(item)}
        else:
            raise RequestValidationError(f"input[{i}]: an item_reference was not resolved", f"input[{i}]")
        if message["role"] == "assistant" and reasoning is not None:
            message["reasoning"] = reasoning
            reasoning = None
        conv.messages.append(message)
        conv.origins.append(i)
        joinable = message["role"] == "assistant"
    return conv


def _tools(req: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    """Chat's ``tools`` and ``tool_choice`` for ``req``."""
    tools = req.tools or []
    choice: Any = req.tool_choice
    if isinstance(choice, ToolChoiceAllowed):
        allowed = {t.get("name") for t in choice.tools}
        tools = [t for t in tools if t.name in allowed]
        choice = choice.mode
    elif isinstance(choice, ToolChoiceFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    chat_tools = [{"type": "function", "function": {
        "name": t.name, **({"description": t.description} if t.description is not None else {}),
        **({"parameters": t.parameters} if t.parameters is not None else {}),
        **({"strict": t.strict} if t.strict is not None else {})}} for t in tools]
    return (chat_tools or None), (choice if chat_tools else None)


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, TextFormatJsonObject):
        return {"type": "json_object"}
    if isinstance(fmt, TextFormatJsonSchema):
        schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.json_schema}
        if fmt.description is not None:
            schema["description"] = fmt.description
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": schema}
    return None


def _template_kwargs(req: ResponsesRequest) -> dict[str, Any] | None:
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is None:
        return None
    return {"reasoning_effort": effort, **({"enable_thinking": False} if effort == "none" else {})}


_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "user", "priority")


def chat_body(req: ResponsesRequest, messages: list[ChatMessage], *, request_id: str | None = None) -> dict[str, Any]:
    """The chat completions body equal to ``req`` over ``messages`` (module docstring): what ``to_chat_request``
    validates; also what a test sends to ``/v1/chat/completions`` to compare."""
    tools, tool_choice = _tools(req)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "n": 1, "stream": bool(req.stream)}
    for name in _SAMPLING:
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    # a forced call is this turn's whole output: text.format is for the answer of a later turn (OpenAI takes both
    # together; the chat schema refuses a forced call beside another constraint)
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    optional = {"tools": tools, "tool_choice": tool_choice, "response_format": None if forced else _response_format(req),
                "max_completion_tokens": req.max_output_tokens, "chat_template_kwargs": _template_kwargs(req),
                "request_id": request_id or req.request_id}
    body.update({k: v for k, v in optional.items() if v is not None})
    if tools:
        body["parallel_tool_calls"] = req.parallel_tool_calls is not False
    if req.wants_logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    return body


def to_chat_request(req: ResponsesRequest, conv: ChatConversion, *, request_id: str | None = None
                    ) -> ChatCompletionRequest:
    """The internal ``ChatCompletionRequest`` of ``req`` over the converted conversation; ``RequestValidationError``
    naming the Responses field (``input[i]...``) when the chat schema refuses it."""
    if not conv.messages:
        raise RequestValidationError("the conversation is empty: send at least one input item", "input")
    body = chat_body(req, conv.messages, request_id=request_id)
    try:
        chat: ChatCompletionRequest = validate_request(ChatCompletionRequest, body)
    except RequestValidationError as exc:
        raise RequestValidationError(exc.message, chat_param_to_input(exc.param, conv), exc.code) from None
    return chat


def chat_param_to_input(param: str | None, conv: ChatConversion) -> str | None:
    """A chat field name (``messages``, ``messages[3].tool_calls[0]...``, ``response_format...``) as the Responses
    field it came from (``input``, ``input[i]``, ``instructions``, ``text.format``, ``max_output_tokens``)."""
    if param is None:
        return None
    for chat, responses in (("response_format", "text.format"), ("max_completion_tokens", "max_output_tokens"),
                            ("max_tokens", "max_output_tokens"), ("tools", "tools"), ("tool_choice", "tool_choice")):
        if param.startswith(chat):
            return responses
    if not param.startswith("messages"):
        return param
    rest = param[len("messages"):]
    index: int | None = None
    if rest.startswith("[") and "]" in rest:
        index = int(rest[1:rest.index("]")]) if rest[1:rest.index("]")].isdigit() else None
    elif rest.startswith("."):
        head = rest[1:].split(".", 1)[0]
        index = int(head) if head.isdigit() else None
    if index is None or index >= len(conv.origins):
        return "input"
    origin = conv.origins[index]
    return "instructions" if origin == INSTRUCTIONS else f"input[{origin}]"


# ----------------------------------------------------------------------------- truncation: auto


def turns(messages: Sequence[ChatMessage]) -> list[tuple[int, int]]:
    """``[start, end)`` message ranges of the droppable turns, oldest first: every message but leading system ones,
    an assistant message with ``tool_calls`` together with the ``tool`` messages right after it. The last turn
    (the newest input) is left out: it is never dropped."""
    start = 0
    while start < len(messages) and messages[start]["role"] in ("system", "developer"):
        start += 1
    out: list[tuple[int, int]] = []
    i = start
    while i < len(messages):
        j = i + 1
        if messages[i]["role"] == "assistant" and messages[i].get("tool_calls"):
            while j < len(messages) and messages[j]["role"] == "tool":
                j += 1
        out.append((i, j))
        i = j
    return out[:-1]


def _size(message: ChatMessage) -> int:
    content = message.get("content")
    size = len(content) if isinstance(content, str) else sum(len(str(p.get("text", ""))) + 8 for p in content or [])
    for call in message.get("tool_calls") or []:
        size += len(call["function"]["name"]) + len(call["function"]["arguments"])
    return size + len(message.get("reasoning") or "") + 8


def turns_to_drop(messages: Sequence[ChatMessage], prompt_tokens: int, max_prompt_tokens: int) -> int:
    """How many of the oldest droppable turns to drop so that a ``prompt_tokens`` prompt fits ``max_prompt_tokens``:
    the turns' sizes are taken as proportional to their tokens (characters), at least one turn when over. The
    caller renders again and asks again while it is still over."""
    excess = prompt_tokens - max_prompt_tokens
    if excess <= 0:
        return 0
    total = sum(_size(m) for m in messages) or 1
    need = excess * total / max(prompt_tokens, 1)
    dropped, count = 0.0, 0
    for start, end in turns(messages):
        if dropped >= need and count:
            break
        dropped += sum(_size(m) for m in messages[start:end])
        count += 1
    return count


def drop_oldest(conv: ChatConversion, count: int) -> ChatConversion | None:
    """``conv`` without its ``count`` oldest droppable turns (``turns``); ``None`` when it has fewer than that (the
    newest input alone does not fit: truncation cannot help)."""
    ranges = turns(conv.messages)
    if count <= 0:
        return conv
    if count > len(ranges):
        return None
    start, end = ranges[0][0], ranges[count - 1][1]
    return ChatConversion(conv.messages[:start] + conv.messages[end:], conv.origins[:start] + conv.origins[end:])


# ----------------------------------------------------------------------------- stored input items

_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def stored_input_item(item: InputItem, new_id: Any) -> dict[str, Any]:
    """``item`` as a stored response keeps it and ``GET .../input_items`` lists it (the SDK's ``ResponseItem``
    shapes): with an ``id`` (the client's, else ``new_id(prefix)``), a message's content as a list of parts, a
    ``status``. Read back by ``stored_items`` into the same input item."""
    data = item.model_dump(exclude_none=True, by_alias=True)
    if isinstance(item, ItemReference):
        raise ValueError("item references are resolved before they are stored")
    if not data.get("id"):
        data["id"] = new_id(_ID_PREFIX[item.type])
    data.setdefault("status", "completed")
    if isinstance(item, MessageItem):
        if isinstance(item.content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            data["content"] = [{"type": kind, "text": item.content}]
        if item.role == "assistant":
            for part in data["content"]:
                if part["type"] == "output_text":
                    part.setdefault("annotations", [])
    return data
