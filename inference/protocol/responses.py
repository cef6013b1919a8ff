"""OpenAI Responses API schemas (pydantic 2, Django-free): the ``POST /v1/responses`` body, its input items, and the
names and shapes of what the platform sends back (output items, statuses, usage, stream events).

Follows the official ``openai`` SDK's types (``openai/types/responses/``): the create parameters of
``response_create_params.py``, the input items of ``response_input_param.py`` (``message`` with ``input_text`` /
``input_image`` parts, or an assistant's ``output_text`` / ``refusal`` parts; ``function_call``;
``function_call_output``; ``reasoning``; ``item_reference``), the ``Response`` object of ``response.py`` and the
events of ``response_stream_event.py``. Types are strict as on chat completions (``inference.protocol.openai``): a
string where a number is expected is a 400 naming the field. Unknown top-level fields are ignored, as every body's;
the hosted tools and items (web search, file search, computer use, MCP, shell...) and ``conversation`` are refused
with a 400 naming the field: this server runs functions only.

A field is named as OpenAI names it: ``input[2].call_id``, ``tools[0].parameters``, ``text.format.schema``.

Limits (OpenAI's where it has one): ``metadata`` at most 16 pairs, keys up to 64 characters, values up to 512;
``input`` at most ``MAX_INPUT_ITEMS`` items (the chat route's ``MAX_MESSAGES``), ``tools`` at most 128,
``top_logprobs`` 0-20.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from inference.protocol.openai import (MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOLS, MAX_TOP_LOGPROBS, ModelName,
                                       RequestId, RequestValidationError)

MAX_INPUT_ITEMS = MAX_MESSAGES
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_LEN = 64
MAX_METADATA_VALUE_LEN = 512
MAX_ITEM_ID_LEN = 128
MAX_CALL_ID_LEN = 128
# what a stored response's id looks like (``new_response_id``): refused before any lookup when it cannot be one
RESPONSE_ID_RE = re.compile(r"^resp_[A-Za-z0-9_-]{1,120}$")

# statuses of a response (``response_status.py``)
STATUS_QUEUED, STATUS_IN_PROGRESS, STATUS_COMPLETED = "queued", "in_progress", "completed"
STATUS_INCOMPLETE, STATUS_FAILED, STATUS_CANCELLED = "incomplete", "failed", "cancelled"
TERMINAL_STATUSES = frozenset({STATUS_COMPLETED, STATUS_INCOMPLETE, STATUS_FAILED, STATUS_CANCELLED})

# ``include`` values the server honours; the others the SDK types list are accepted and have nothing to add here
INCLUDE_OUTPUT_LOGPROBS = "message.output_text.logprobs"
KNOWN_INCLUDES = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content", INCLUDE_OUTPUT_LOGPROBS,
})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, populate_by_name=True)


# ----------------------------------------------------------------------------- input items

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class InputText(_Strict):
    """``{"type": "input_text", "text"}``."""

    type: Literal["input_text"]
    text: str


class InputImage(_Strict):
    """``{"type": "input_image", "image_url", "detail"}``: a URL or a ``data:`` URL (``file_id``, the Files API, is
    not served here)."""

    type: Literal["input_image"]
    image_url: str | None = None
    detail: Literal["low", "high", "auto", "original"] | None = "auto"


class OutputTextPart(_Strict):
    """An assistant message's ``{"type": "output_text", "text"}`` (annotations and logprobs are not read)."""

    type: Literal["output_text"]
    text: str


class RefusalPart(_Strict):
    """An assistant message's ``{"type": "refusal", "refusal"}``."""

    type: Literal["refusal"]
    refusal: str


ContentPart = InputText | InputImage | OutputTextPart | RefusalPart
_PART_TYPES: dict[str, type[_Strict]] = {"input_text": InputText, "input_image": InputImage,
                                         "output_text": OutputTextPart, "refusal": RefusalPart}


class MessageItem(_Strict):
    """A ``message`` item: ``role`` and ``content``, a string or parts. ``type`` may be left out (the SDK's
    ``EasyInputMessageParam``). User, system and developer messages take ``input_text``/``input_image`` parts, an
    assistant's ``output_text``/``refusal`` parts."""

    type: Literal["message"] = "message"
    id: str | None = Field(default=None, max_length=MAX_ITEM_ID_LEN)
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    status: ItemStatus | None = None


class FunctionCallItem(_Strict):
    """A ``function_call`` the model made: ``call_id``, ``name``, ``arguments`` (a JSON object as a string)."""

    type: Literal["function_call"]
    id: str | None = Field(default=None, max_length=MAX_ITEM_ID_LEN)
    call_id: str = Field(min_length=1, max_length=MAX_CALL_ID_LEN)
    name: str = Field(min_length=1, max_length=128)
    arguments: str
    status: ItemStatus | None = None

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            value = json.loads(v)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"must be a JSON object encoded as a string (e.g. '{{\"city\": \"Paris\"}}'), got "
                             f"{v[:80]!r}")
        return v


class FunctionCallOutputItem(_Strict):
    """A ``function_call_output``: the result of the call ``call_id``, a string or ``input_text`` parts."""

    type: Literal["function_call_output"]
    id: str | None = Field(default=None, max_length=MAX_ITEM_ID_LEN)
    call_id: str = Field(min_length=1, max_length=MAX_CALL_ID_LEN)
    output: str | list[InputText]
    status: ItemStatus | None = None


class SummaryText(_Strict):
    """``{"type": "summary_text", "text"}``."""

    type: Literal["summary_text"]
    text: str


class ReasoningText(_Strict):
    """``{"type": "reasoning_text", "text"}``."""

    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    """A ``reasoning`` item: the model's reasoning text (``content``) and ``summary``. ``encrypted_content`` is not
    produced here, so it is not read either."""

    type: Literal["reasoning"]
    id: str | None = Field(default=None, max_length=MAX_ITEM_ID_LEN)
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    status: ItemStatus | None = None


class ItemReference(_Strict):
    """``{"type": "item_reference", "id"}``: an item of one of the caller's stored responses."""

    type: Literal["item_reference"]
    id: str = Field(min_length=1, max_length=MAX_ITEM_ID_LEN)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | ItemReference
_ITEM_TYPES: dict[str, type[_Strict]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                         "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem,
                                         "item_reference": ItemReference}


def param_of(loc: tuple[Any, ...], prefix: str = "") -> str:
    """OpenAI's name of the field at pydantic location ``loc`` under ``prefix``: ``input[2].content[0].text``."""
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list", "dict", "int", "float", "bool", "function-after") or \
                (isinstance(part, str) and ("[" in part or part in _ITEM_TYPES or part in _PART_TYPES)):
            continue  # union members and tags pydantic adds to the location
        else:
            out = f"{out}.{part}" if out else str(part)
    return out


def _first_error(exc: ValidationError, prefix: str) -> RequestValidationError:
    first = exc.errors(include_url=False)[0]
    ctx_err = (first.get("ctx") or {}).get("error")
    param = param_of(tuple(first.get("loc", ())), prefix)
    if isinstance(ctx_err, RequestValidationError):
        return RequestValidationError(ctx_err.message, ctx_err.param or param, ctx_err.code)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return RequestValidationError(f"Invalid value for '{param}': {msg}", param)


def validate_at(model_cls: type[_Strict], data: Any, prefix: str) -> Any:
    """``data`` validated into ``model_cls``; a ``RequestValidationError`` naming the field under ``prefix``."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise _first_error(exc, prefix) from None


def _content_parts(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """A message's content parts validated one by one (each error names its part), an unknown part type refused."""
    content = raw.get("content")
    if not isinstance(content, list):
        return raw
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        cls = _PART_TYPES.get(kind) if isinstance(kind, str) else None
        if cls is None:
            why = " (files are not supported by this server)" if kind == "input_file" else ""
            raise RequestValidationError(
                f"{where}.content[{j}].type must be one of 'input_text', 'input_image', 'output_text', 'refusal'; "
                f"got {kind!r}{why}", f"{where}.content[{j}].type")
        parts.append(validate_at(cls, part, f"{where}.content[{j}]"))
    return {**raw, "content": parts}


def parse_input_item(index: int, raw: Any) -> InputItem:
    """One ``input`` entry validated into its item class (``type``, or a ``role`` without one: a message); a
    ``RequestValidationError`` naming ``input[index]...`` for an unknown type or a bad field."""
    where = f"input[{index}]"
    if not isinstance(raw, dict):
        raise RequestValidationError(f"{where} must be an object (an input item)", where)
    kind = raw.get("type", "message" if "role" in raw else None)
    cls = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RequestValidationError(
            f"{where}.type {kind!r} is not supported: input items are 'message', 'function_call', "
            "'function_call_output', 'reasoning' and 'item_reference' (hosted tools are not served here)",
            f"{where}.type")
    if cls is MessageItem:
        raw = _content_parts(raw, where)
    item: InputItem = validate_at(cls, raw, where)
    if isinstance(item, MessageItem) and isinstance(item.content, list):
        _check_message_parts(item, where)
    if isinstance(item, FunctionCallOutputItem) and isinstance(item.output, list) and not item.output:
        raise RequestValidationError(f"{where}.output must not be an empty list", f"{where}.output")
    return item


def _check_message_parts(item: MessageItem, where: str) -> None:
    assistant = item.role == "assistant"
    for j, part in enumerate(item.content):
        if assistant != isinstance(part, (OutputTextPart, RefusalPart)):
            allowed = "'output_text' and 'refusal'" if assistant else "'input_text' and 'input_image'"
            raise RequestValidationError(f"{where}.content[{j}]: {'an' if assistant else 'a'} {item.role} message "
                                         f"takes {allowed} parts",
                                         f"{where}.content[{j}].type")
        if isinstance(part, InputImage) and not part.image_url:
            raise RequestValidationError(
                f"{where}.content[{j}].image_url is required (file_id, the Files API, is not supported here)",
                f"{where}.content[{j}].image_url")


# ----------------------------------------------------------------------------- tools, text, reasoning


class FunctionTool(_Strict):
    """A flat function tool: ``{"type": "function", "name", "description", "parameters", "strict"}``."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # as chat's (written into the prompt)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Strict):
    """``{"type": "function", "name"}``: call this function."""

    type: Literal["function"]
    name: str


class ToolChoiceAllowed(_Strict):
    """``{"type": "allowed_tools", "mode", "tools"}``: only these functions, ``auto`` or ``required``."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_TOOLS)


ToolChoice = Literal["none", "auto", "required"] | ToolChoiceFunction | ToolChoiceAllowed


class TextFormatText(_Strict):
    """``{"type": "text"}``: no constraint."""

    type: Literal["text"]


class TextFormatJsonObject(_Strict):
    """``{"type": "json_object"}``: any JSON object."""

    type: Literal["json_object"]


class TextFormatJsonSchema(_Strict):
    """``{"type": "json_schema", "name", "schema", "description", "strict"}`` (flat, unlike chat's
    ``response_format.json_schema``)."""

    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = TextFormatText | TextFormatJsonObject | TextFormatJsonSchema
_FORMAT_TYPES: dict[str, type[_Strict]] = {"text": TextFormatText, "json_object": TextFormatJsonObject,
                                           "json_schema": TextFormatJsonSchema}


class TextConfig(_Strict):
    """``text``: ``format`` and ``verbosity`` (accepted; the model has no such setting)."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _format_by_type(cls, data: Any) -> Any:
        fmt = data.get("format") if isinstance(data, dict) else None
        if not isinstance(fmt, dict):
            return data
        kind = fmt.get("type")
        fmt_cls = _FORMAT_TYPES.get(kind) if isinstance(kind, str) else None
        if fmt_cls is None:
            raise RequestValidationError(f"text.format.type must be 'text', 'json_object' or 'json_schema'; got "
                                         f"{kind!r}", "text.format.type")
        return {**data, "format": validate_at(fmt_cls, fmt, "text.format")}


class ReasoningConfig(_Strict):
    """``reasoning``: ``effort`` is handed to the chat template (``reasoning_effort``; ``none`` also turns
    ``enable_thinking`` off); ``summary`` is accepted (no summaries are written: the reasoning text itself is)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


# ----------------------------------------------------------------------------- the request

_UNSUPPORTED_FIELDS = {"conversation": "the Conversations API is not served here: use previous_response_id",
                       "prompt": "stored prompt templates are not served here"}


class ResponsesRequest(_Strict):
    """``POST /v1/responses`` (and ``/v1/responses/input_tokens``) body."""

    model: ModelName = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, max_length=128)
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    max_tool_calls: int | None = Field(default=None, ge=1)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = Field(default=None, max_length=16)
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    store: bool | None = True
    background: bool | None = False
    stream: bool | None = False
    user: str | None = Field(default=None, max_length=512)
    safety_identifier: str | None = Field(default=None, max_length=512)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    request_id: RequestId = None
    priority: int | None = Field(default=0, ge=0, le=2**31 - 1)
    # vLLM's extension, as on chat: the response object also carries the prompt's token ids (``prompt_token_ids``)
    return_token_ids: bool | None = False

    @model_validator(mode="before")
    @classmethod
    def _items_first(cls, data: Any) -> Any:
        """Unsupported top-level fields, then the input items one by one (each names its own field)."""
        if not isinstance(data, dict):
            return data
        for name, why in _UNSUPPORTED_FIELDS.items():
            if data.get(name) is not None:
                raise RequestValidationError(f"'{name}' is not supported: {why}", name)
        _check_tools_raw(data.get("tools"))
        raw = data.get("input")
        if isinstance(raw, list):
            if len(raw) > MAX_INPUT_ITEMS:
                raise RequestValidationError(f"input may hold at most {MAX_INPUT_ITEMS} items, got {len(raw)}",
                                             "input")
            data = {**data, "input": [parse_input_item(i, item) for i, item in enumerate(raw)]}
        return data

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return None
        if len(v) > MAX_METADATA_PAIRS:
            raise RequestValidationError(f"metadata may hold at most {MAX_METADATA_PAIRS} key-value pairs, got "
                                         f"{len(v)}", "metadata")
        for key, value in v.items():
            if len(key) > MAX_METADATA_KEY_LEN:
                raise RequestValidationError(f"metadata keys may be at most {MAX_METADATA_KEY_LEN} characters; "
                                             f"{key[:80]!r} has {len(key)}", "metadata")
            if len(value) > MAX_METADATA_VALUE_LEN:
                raise RequestValidationError(f"metadata values may be at most {MAX_METADATA_VALUE_LEN} characters; "
                                             f"the value of {key[:64]!r} has {len(value)}", f"metadata.{key}")
        return v

    @field_validator("include")
    @classmethod
    def _include(cls, v: list[str] | None) -> list[str] | None:
        for i, name in enumerate(v or []):
            if name not in KNOWN_INCLUDES:
                raise RequestValidationError(f"include[{i}] {name[:80]!r} is not a known value (one of "
                                             f"{sorted(KNOWN_INCLUDES)})", f"include[{i}]")
        return v

    @field_validator("previous_response_id")
    @classmethod
    def _previous_id(cls, v: str | None) -> str | None:
        if v is not None and not RESPONSE_ID_RE.fullmatch(v):
            raise RequestValidationError(f"previous_response_id {v[:80]!r} is not a response id (resp_...)",
                                         "previous_response_id")
        return v

    @model_validator(mode="after")
    def _cross(self) -> ResponsesRequest:
        if isinstance(self.input, list):
            parts = sum(len(i.content) for i in self.input if isinstance(i, MessageItem) and
                        isinstance(i.content, list))
            if parts > MAX_CONTENT_PARTS:
                raise RequestValidationError(f"input may hold at most {MAX_CONTENT_PARTS} content parts in all",
                                             "input")
        if self.input is None or self.input == [] or self.input == "":
            if self.previous_response_id is None:
                raise RequestValidationError("'input' is required (a string or a list of input items)", "input")
        if self.background and self.store is False:
            raise RequestValidationError("background responses must be stored: 'background': true requires "
                                         "'store': true", "background")
        check_tool_choice(self.tools, self.tool_choice)
        return self

    @property
    def wants_logprobs(self) -> bool:
        """True when the output's token logprobs are to be returned (``include`` names them)."""
        return INCLUDE_OUTPUT_LOGPROBS in (self.include or [])

    @property
    def input_items(self) -> list[InputItem]:
        """``input`` as items: a string is one user message."""
        if self.input is None or self.input == "":
            return []
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)


def _check_tools_raw(tools: Any) -> None:
    """A hosted tool (``web_search``, ``file_search``, ``mcp``...) is refused by name before the schema's errors."""
    if not isinstance(tools, list):
        return
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise RequestValidationError(f"tools[{i}].type {kind!r} is not supported: only 'function' tools are "
                                         "served here", f"tools[{i}].type")


def check_tool_choice(tools: list[FunctionTool] | None, choice: ToolChoice | None) -> None:
    """``tool_choice`` against ``tools``: unique names; anything but ``none`` needs tools; a named or allowed
    function must be one of them. ``RequestValidationError`` naming the field."""
    names = [t.name for t in tools or []]
    if tools is not None and len(set(names)) != len(names):
        raise RequestValidationError("tool names must be unique", "tools")
    if choice is None or choice == "none" or (choice == "auto" and not tools):
        return
    if not tools:
        raise RequestValidationError("tool_choice requires 'tools'", "tool_choice")
    if isinstance(choice, ToolChoiceFunction) and choice.name not in names:
        raise RequestValidationError(f"tool_choice names {choice.name!r}, which is not one of the tools {names}",
                                     "tool_choice.name")
    if isinstance(choice, ToolChoiceAllowed):
        for j, allowed in enumerate(choice.tools):
            if allowed.get("type") != "function" or allowed.get("name") not in names:
                raise RequestValidationError(f"tool_choice.tools[{j}] must be {{'type': 'function', 'name': <one of "
                                             f"the tools {names}>}}", f"tool_choice.tools[{j}]")


def validate_responses_request(data: dict[str, Any]) -> ResponsesRequest:
    """``data`` validated as a ``ResponsesRequest``; ``RequestValidationError`` naming the first bad field."""
    try:
        return ResponsesRequest.model_validate(data)
    except RequestValidationError:
        raise
    except ValidationError as exc:
        raise _first_error(exc, "") from None


class InputItemsQuery(_Strict):
    """``GET /v1/responses/{id}/input_items`` query: ``after``/``before`` (item ids), ``limit`` 1-100 (20),
    ``order`` ``asc``/``desc`` (``desc``)."""

    after: str | None = Field(default=None, max_length=MAX_ITEM_ID_LEN)
    before: str | None = Field(default=None, max_length=MAX_ITEM_ID_LEN)
    limit: int = Field(default=20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"


# ----------------------------------------------------------------------------- what is sent back


Usage = dict[str, Any]
"""``usage`` of a response (``response_usage.py``): ``input_tokens``, ``input_tokens_details``, ``output_tokens``,
``output_tokens_details``, ``total_tokens``."""


def usage_object(input_tokens: int, output_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0) -> Usage:
    """The ``usage`` object: ``cached_tokens`` of the input (served by a replica's prefix cache), ``reasoning_tokens``
    of the output. ``cache_write_tokens`` (OpenAI's explicit cache breakpoints) is always 0: the prefix cache is
    implicit."""
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


# Stream event types, in the order a response's events come (``response_stream_event.py``)
EV_CREATED, EV_QUEUED, EV_IN_PROGRESS = "response.created", "response.queued", "response.in_progress"
EV_ITEM_ADDED, EV_ITEM_DONE = "response.output_item.added", "response.output_item.done"
EV_PART_ADDED, EV_PART_DONE = "response.content_part.added", "response.content_part.done"
EV_TEXT_DELTA, EV_TEXT_DONE = "response.output_text.delta", "response.output_text.done"
EV_REASONING_DELTA, EV_REASONING_DONE = "response.reasoning_text.delta", "response.reasoning_text.done"
EV_ARGS_DELTA, EV_ARGS_DONE = "response.function_call_arguments.delta", "response.function_call_arguments.done"
EV_COMPLETED, EV_INCOMPLETE, EV_FAILED = "response.completed", "response.incomplete", "response.failed"
EV_ERROR = "error"
TERMINAL_EVENTS = frozenset({EV_COMPLETED, EV_INCOMPLETE, EV_FAILED})
