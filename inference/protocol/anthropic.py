"""Anthropic Messages API wire shapes (pydantic 2): the ``POST /v1/messages`` and ``/v1/messages/count_tokens``
bodies, the error envelope and the status mapping of its error types. Django-free.

Follows the official ``anthropic`` SDK's types (``types/message_create_params.py``, ``types/*_block_param.py``,
``types/shared/*_error.py``). Validation is strict as on the OpenAI routes (a string where a number is expected is a
400 naming the field); unknown keys are ignored (``cache_control``, ``citations``, ``service_tier``,
``container`` ...). What the platform cannot serve is refused by name rather than ignored: ``document`` and the
server-tool blocks, server tools (a ``type`` other than ``custom``), images inside a ``tool_result``.

Limits beside Anthropic's: ``temperature`` [0, 1], ``top_k`` ≥ 0, ``metadata.user_id`` at most 256 characters,
``thinking.budget_tokens`` ≥ 1 and below ``max_tokens`` (Anthropic's minimum of 1,024 is for its own models: a
small served model's whole context may be shorter; DECISIONS). The platform's own caps apply after conversion to the
internal request (``inference.protocol.openai``: at most 4 stop sequences, 2,048 messages, 128 tools).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from inference.protocol.openai import MAX_MESSAGES, MAX_TOOLS, ModelName, RequestValidationError

DEFAULT_VERSION = "2023-06-01"
"""The ``anthropic-version`` a request without the header is served as."""
MAX_USER_ID_LEN = 256


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextBlock(_Base):
    """``{"type": "text", "text"}``."""

    type: Literal["text"]
    text: str


class Base64ImageSource(_Base):
    """An image sent inline: ``{"type": "base64", "media_type", "data"}``."""

    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)


class UrlImageSource(_Base):
    """An image fetched by the platform: ``{"type": "url", "url"}`` (the multimodal workers' fetch rules)."""

    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlock(_Base):
    """``{"type": "image", "source": {...}}``."""

    type: Literal["image"]
    source: Annotated[Base64ImageSource | UrlImageSource, Field(discriminator="type")]


class ToolUseBlock(_Base):
    """A call the assistant made: ``{"type": "tool_use", "id", "name", "input": {...}}``."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any]


class ToolResultBlock(_Base):
    """A call's result: ``{"type": "tool_result", "tool_use_id", "content"?: str | text blocks, "is_error"?}``."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Base):
    """Reasoning the platform returned earlier, with its signature (verified on replay)."""

    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingBlock(_Base):
    """Opaque reasoning (``data``): accepted in history, not rendered (the platform never emits one)."""

    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                         | RedactedThinkingBlock, Field(discriminator="type")]
"""A block of a message's ``content``; another ``type`` is a 400 naming the block."""


class MessageParam(_Base):
    """One turn: ``role`` ``user`` or ``assistant``, ``content`` a string or blocks."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolParam(_Base):
    """A client tool: ``name``, ``description``, ``input_schema`` (a JSON schema of ``type`` ``object``)."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None

    @model_validator(mode="after")
    def _object_schema(self) -> ToolParam:
        if self.input_schema.get("type") != "object":
            raise RequestValidationError("must be a JSON schema of type 'object'", "input_schema")
        return self


class ToolChoiceAuto(_Base):
    """The model decides whether to call a tool."""

    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Base):
    """The model calls one of the tools."""

    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Base):
    """The model calls the tool ``name``."""

    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Base):
    """The model calls no tool."""

    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(_Base):
    """Reasoning on, bounded by ``budget_tokens`` output tokens."""

    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)


class ThinkingDisabled(_Base):
    """Reasoning off (the template's ``enable_thinking`` false)."""

    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled, Field(discriminator="type")]


class Metadata(_Base):
    """``metadata``: ``user_id``, an opaque id of the end user."""

    user_id: str | None = Field(default=None, max_length=MAX_USER_ID_LEN)


class _ConversationFields(_Base):
    """What both routes read: the conversation, its tools and the reasoning switch."""

    model: ModelName = None
    messages: list[MessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @model_validator(mode="after")
    def _check_tools(self) -> _ConversationFields:
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise RequestValidationError("tool names must be unique", "tools")
        choice = self.tool_choice
        if isinstance(choice, (ToolChoiceAny, ToolChoiceTool)) and not names:
            raise RequestValidationError(f"tool_choice of type '{choice.type}' requires 'tools'", "tool_choice")
        if isinstance(choice, ToolChoiceTool) and choice.name not in names:
            raise RequestValidationError(f"{choice.name!r} is not one of the tools {names}", "tool_choice.name")
        return self


class MessagesRequest(_ConversationFields):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None

    @model_validator(mode="after")
    def _check_budget(self) -> MessagesRequest:
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise RequestValidationError(
                f"{self.thinking.budget_tokens} must be less than max_tokens ({self.max_tokens})",
                "thinking.budget_tokens")
        return self


class CountTokensRequest(_ConversationFields):
    """``POST /v1/messages/count_tokens``: the conversation, its tools and the reasoning switch."""


_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "dict", "list", "function-after"})


def _param(loc: tuple[Any, ...], data: Any) -> str | None:
    """A pydantic error location as the field's dotted path in the client's body ``data``: the names pydantic adds
    for union members (``str``, ``list[...]``) and the discriminators' tags (a block's ``type``) left out."""
    node, out, tagged = data, [], False
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out.append(str(part))
            node, tagged = (node[part] if isinstance(node, list) and 0 <= part < len(node) else None), False
        elif isinstance(node, dict) and node.get("type") == part and i + 1 < len(loc) and not tagged:
            tagged = True  # a discriminator's tag: the field inside the block follows
        elif isinstance(node, dict) and part in node:
            out.append(part)
            node, tagged = node[part], False
        elif "[" in part or part in _UNION_MEMBERS:
            continue
        else:
            out.append(part)  # a field that is missing
            node = None
    return ".".join(out) or None


def validate_body(schema: type[MessagesRequest] | type[CountTokensRequest], data: dict[str, Any]) -> Any:
    """``data`` validated into ``schema``; ``RequestValidationError`` whose message starts with the field's path
    (``messages.0.content.1.source.data: Field required``), as its ``param``. Of the errors pydantic gives for a union
    (a string or blocks), the one that went deepest is reported: the branch the client meant."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = max(errors, key=lambda e: len(e.get("loc", ())))
        param = _param(tuple(first.get("loc", ())), data)
        inner = (first.get("ctx") or {}).get("error")
        if isinstance(inner, RequestValidationError):
            param = ".".join(p for p in (param, inner.param) if p) or None
            msg = inner.message
        else:
            msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise RequestValidationError(f"{param or 'body'}: {msg}", param) from None


_PARAMS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "stop": "stop_sequences",
           "user": "metadata.user_id", "chat_template_kwargs": "thinking", "tool_choice": "tool_choice",
           "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "messages": "messages",
           "continue_final_message": "messages", "model": "model"}


def anthropic_param(param: str | None) -> str | None:
    """The Messages field of an internal request's ``param`` (``stop`` → ``stop_sequences``,
    ``tools[2].function.parameters`` → ``tools.2.input_schema``, ``messages[5]...`` → ``messages``: the internal list
    has the system prompt and the tool results as messages of their own, so its indices are not the client's)."""
    if not param:
        return param
    if param.startswith("tools["):
        index = param[len("tools["):].split("]", 1)[0]
        return f"tools.{index}.input_schema" if "parameters" in param else f"tools.{index}"
    head = param.split(".", 1)[0].split("[", 1)[0]
    return _PARAMS.get(head, param)


# ------------------------------------------------------------------------------------------------------- errors
# (status, our ErrorCode) -> (status, Anthropic error type), the specific pairs first; then by status alone
_BY_CODE: dict[tuple[int, str], tuple[int, str]] = {
    (429, "insufficient_quota"): (402, "billing_error"),  # a token budget exhausted
    (503, "server_overloaded"): (529, "overloaded_error"),  # admission shed the request
}
_BY_STATUS: dict[int, str] = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                              403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                              408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                              529: "overloaded_error"}


def error_status_type(status: int, code: str | None) -> tuple[int, str]:
    """The Anthropic status and error ``type`` of an error the gateway answers with ``status`` and ``code``: 402
    ``billing_error`` for an exhausted budget, 529 ``overloaded_error`` when admission sheds, the 4xx by their
    Anthropic names, any other 5xx ``api_error`` with its own status (a 503 stays 503: retried by the SDK)."""
    mapped = _BY_CODE.get((status, code or ""))
    if mapped is not None:
        return mapped
    return status, _BY_STATUS.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(type_: str, message: str, request_id: str | None) -> bytes:
    """Anthropic's error envelope ``{"type": "error", "error": {"type", "message"}, "request_id"}`` as JSON bytes."""
    return json.dumps({"type": "error", "error": {"type": type_, "message": message}, "request_id": request_id},
                      separators=(",", ":")).encode()
