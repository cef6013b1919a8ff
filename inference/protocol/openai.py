"""OpenAI-compatible request schemas (pydantic 2) for chat completions and completions.

Types are strict as in the OpenAI API: a string where an integer or number is expected, a float where an
integer is expected, or a boolean where a number is expected is a 400 naming the field (conformance C14,
C29). ``null`` means "not provided" for every optional field (C15). Unknown top-level fields are accepted
and ignored (C28, vLLM's ``OpenAIBaseModel``). Ranges follow OpenAI and vLLM's ``protocol.py``
(reference/vllm_frontend.md §2): temperature [0, 2], top_p (0, 1], penalties [-2, 2], n [1, 128],
logit_bias values [-100, 100], at most 4 stop strings, top_logprobs [0, 20].

Cross-field rules that need the model (lengths, vocabulary) live in ``inference.input_processor``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_STOP_STRINGS = 4
MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_REQUEST_ID_LEN = 128


class RequestValidationError(ValueError):
    """A request failed validation; maps to HTTP 400 ``invalid_request_error``.

    ``param`` names the offending field (dotted path for nested fields), ``None`` when no single field is
    to blame.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def _reject_constant(name: str) -> Any:
    raise RequestValidationError(f"Invalid JSON: {name} is not a valid JSON number", None)


def parse_json_body(body: bytes) -> dict[str, Any]:
    """Parse a request body that must be one JSON object.

    Raises ``RequestValidationError`` for invalid UTF-8, invalid JSON, ``NaN``/``Infinity`` literals
    (not JSON, although Python accepts them) or a top level that is not an object.
    """
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except RequestValidationError:
        raise
    except (UnicodeDecodeError, ValueError) as exc:
        raise RequestValidationError(f"Invalid JSON body: {exc}", None) from None
    if not isinstance(data, dict):
        raise RequestValidationError("The request body must be a JSON object", None)
    return data


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, populate_by_name=True)


class StreamOptions(_Base):
    """``stream_options``: ``include_usage`` adds a final usage chunk (OpenAI)."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: str | None = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One chat message. ``content`` is a string, a list of content parts, or null.

    Extra keys (``name``, ``reasoning``, ...) are kept and passed to the template as they came.
    """

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _SamplingFields(_Base):
    """Sampling fields shared by chat and completions (OpenAI + vLLM extensions)."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(default=0, ge=0)
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: str | None = Field(default=None, max_length=MAX_REQUEST_ID_LEN)
    return_token_ids: bool | None = False

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str]:
        if v is None:
            return []
        items = [v] if isinstance(v, str) else v
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed")
        if any(s == "" for s in items):
            raise ValueError("stop sequences must not be empty strings")
        return items

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return None
        for key, value in v.items():
            try:
                if int(key) < 0:
                    raise ValueError
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {key}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, v: list[int] | None) -> list[int]:
        if v is None:
            return []
        if any(i < 0 for i in v):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return v

    @model_validator(mode="after")
    def _check_cross(self) -> "_SamplingFields":
        if self.stream_options is not None and not self.stream:
            if self.stream_options.include_usage or self.stream_options.continuous_usage_stats:
                raise RequestValidationError("stream_options can only be set when stream is true",
                                             "stream_options")
        if self.n and self.n > 1 and self.temperature is not None and self.temperature < 1e-5:
            raise RequestValidationError("n must be 1 when using greedy sampling (temperature 0)", "n")
        return self


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions`` body (OpenAI chat API plus vLLM's templating extensions)."""

    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = False

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must contain at least one message")
        return v

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.add_generation_prompt and self.continue_final_message and \
                "add_generation_prompt" in self.model_fields_set:
            raise RequestValidationError(
                "continue_final_message and add_generation_prompt cannot both be true: continue the final "
                "assistant message or start a new one, not both", "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise RequestValidationError(
                "continue_final_message requires the last message to be from the assistant",
                "continue_final_message")
        if self.top_logprobs and not self.logprobs:
            raise RequestValidationError("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.tools is not None and len(self.tools) == 0:
            raise RequestValidationError("tools must not be an empty array", "tools")
        if self.chat_template_kwargs:
            for bad in ("chat_template", "tokenize"):
                if bad in self.chat_template_kwargs:
                    raise RequestValidationError(
                        f"chat_template_kwargs must not contain {bad!r}", "chat_template_kwargs")
        return self

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """``(value, field name)`` of the client's output cap: ``max_completion_tokens`` wins."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body. ``prompt``: a string, a list of token ids, or a list with one of those.

    Several prompts in one request are a later feature; a list of more than one prompt is refused with 400.
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = False
    add_special_tokens: bool | None = True

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if len(v) == 0:
                raise ValueError("prompt must not be empty")
            if all(isinstance(x, int) for x in v):
                if any(x < 0 for x in v):
                    raise ValueError("prompt token ids must be non-negative")
                return v
            if len(v) > 1:
                raise ValueError("only one prompt per request is supported")
            inner = v[0]
            if isinstance(inner, list) and len(inner) == 0:
                raise ValueError("prompt must not be empty")
            if isinstance(inner, list) and any(x < 0 for x in inner):
                raise ValueError("prompt token ids must be non-negative")
            return inner
        return v

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """``(value, "max_tokens")``; ``null`` means the OpenAI default of 16."""
        return (16 if self.max_tokens is None else self.max_tokens), "max_tokens"


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in {"function-after"}))]
    # pydantic adds union-member names such as 'str' or 'list[int]' to the location: drop them
    cleaned = [p for p in parts if p not in {"str", "int", "float", "bool", "list", "dict", "list[int]",
                                             "list[str]", "list[list[int]]", "list[dict[str,any]]"}]
    return ".".join(cleaned) if cleaned else None


def validate_request(model_cls: type[_Base], data: dict[str, Any]) -> Any:
    """Validate ``data`` into ``model_cls``; raise ``RequestValidationError`` naming the first bad field."""
    try:
        return model_cls.model_validate(data)
    except RequestValidationError:
        raise
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        param = _loc_to_param(tuple(first.get("loc", ())))
        ctx_err = (first.get("ctx") or {}).get("error")
        if isinstance(ctx_err, RequestValidationError):
            raise RequestValidationError(ctx_err.message, ctx_err.param or param) from None
        msg = first.get("msg", "invalid value")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        where = f"'{param}'" if param else "the request body"
        text = f"Invalid value for {where}: {msg}"
        if len(errors) > 1:
            text += f" (and {len(errors) - 1} more error(s))"
        raise RequestValidationError(text, param) from None
