"""OpenAI-compatible request schemas (pydantic 2) for chat completions and completions.

Types are strict as in the OpenAI API: a string where an integer or number is expected, a float where an
integer is expected, or a boolean where a number is expected is a 400 naming the field (conformance C14,
C29). ``null`` means "not provided" for every optional field (C15). Unknown top-level fields are accepted
and ignored (C28, vLLM's ``OpenAIBaseModel``). Ranges follow OpenAI and vLLM's ``protocol.py``
(vLLM's ``vllm/entrypoints/openai/*/protocol.py``): temperature [0, 2], top_p (0, 1], penalties [-2, 2], n [1, 128],
logit_bias values [-100, 100], at most 4 stop strings, top_logprobs [0, 20].

Size caps (no body under the 16 MB body cap may make a process allocate more than 10x its size,
nor spend CPU quadratic in it); each over-cap value is a 400 naming the field:

=========================  =======  ==============================================================
cap                        value    source / reason
=========================  =======  ==============================================================
``MAX_STOP_STRING_LEN``    1,024    characters per stop string (OpenAI documents none; Bedrock caps
                                    at 1,000); 4 strings, so 4,096 in total
``MAX_STOP_TOKEN_IDS``     256      ``stop_token_ids`` / ``eos_token_ids`` entries (after removing
                                    duplicates, which are dropped)
``MAX_LOGIT_BIAS``         300      ``logit_bias`` entries (OpenAI's limit)
``MAX_MODEL_NAME_LEN``     128      ``model``; also the registry's charset (``SERVED_MODEL_NAME_RE``)
``MAX_MESSAGES``           2,048    ``messages`` entries (ours; see docs/DECISIONS.md)
``MAX_TOOLS``              128      ``tools`` entries (OpenAI: "A max of 128 functions")
``MAX_DOCUMENTS``          256      ``documents`` entries
``MAX_CONTENT_PARTS``      4,096    content parts over all messages
``MAX_REQUEST_ID_LEN``     128      ``request_id``; no control characters (it is echoed in a header)
=========================  =======  ==============================================================

Cross-field rules that need the model (lengths, vocabulary) live in ``inference.api.input_processor``.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import numpy as np
import pydantic_core
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

MAX_STOP_STRINGS = 4
MAX_N = 128
# prompts in one /v1/completions request (vLLM's VLLM_MAX_COMPLETION_PROMPTS default); also the most choices
# (prompts x n) one such request may ask for
MAX_COMPLETION_PROMPTS = 1024
MAX_TOP_LOGPROBS = 20
MAX_REQUEST_ID_LEN = 128
MAX_STOP_STRING_LEN = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300
MAX_MODEL_NAME_LEN = 128
MAX_MESSAGES = 2048
MAX_TOOLS = 128
MAX_DOCUMENTS = 256
MAX_CONTENT_PARTS = 4096
# The registry's rule for a served model name (platform/registry/models.py SERVED_MODEL_NAME_RE, kept equal by
# tests/security/test_caps_amplification.py): a ``model`` that does not match can name no served model.
SERVED_MODEL_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"
_MODEL_NAME = re.compile(SERVED_MODEL_NAME_RE)
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class RequestValidationError(ValueError):
    """A request failed validation; maps to HTTP 400 ``invalid_request_error``.

    ``param`` names the offending field (dotted path for nested fields), ``None`` when no single field is
    to blame; ``code``, the error's ``code`` when it has one (``ErrorCode``, e.g. ``context_length_exceeded``).
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def _reject_constant(name: str) -> Any:
    raise RequestValidationError(f"Invalid JSON: {name} is not a valid JSON number", None)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# A surrogate encoded as UTF-8 bytes (invalid UTF-8, but both parsers decode it "surrogatepass").
_SURROGATE_BYTES = re.compile(rb"\xed[\xa0-\xbf]")


def _lone_surrogate_path(data: Any) -> str | None:
    """Dotted path of the first string holding a lone UTF-16 surrogate (``"\\ud800"`` is valid JSON but no
    valid Unicode text), or ``None``. Iterative, so a deep structure cannot exhaust the stack."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or None
        elif isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


MAX_JSON_DEPTH = 100
# Every JSON object/array becomes a Python dict/list of 56-250 bytes however short its text ("{}," is 3
# bytes): 16 MB of them parse into ~700 MB. No API body needs this many (2,048 messages with tool calls,
# 4,096 content parts and 128 tool schemas stay far below); a body with more is refused before parsing, so
# parsing allocates at most ~10x the body plus a bounded amount.
MAX_JSON_CONTAINERS = 50_000


def _json_containers(body: bytes) -> int:
    """Number of ``{`` and ``[`` in ``body`` outside JSON strings (objects + arrays of valid JSON; any
    count for invalid JSON, which the parser refuses anyway). Linear, vectorised (~0.1 s and ~5 copies of
    a 16 MB body, and only when a plain count of ``{``/``[`` exceeds the cap): escape pairs (``\\\\``,
    then ``\\"``) are removed left to right as JSON pairs them; what follows an odd number of quotes is
    inside a string."""
    rough = body.count(b"{") + body.count(b"[")
    if rough <= MAX_JSON_CONTAINERS:
        return rough  # an upper bound is enough
    text = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), dtype=np.uint8)
    inside = np.logical_xor.accumulate(text == ord('"'))
    return int(np.count_nonzero(((text == ord("{")) | (text == ord("["))) & ~inside))


def _too_deep(data: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when ``data`` nests objects/arrays more than ``limit`` levels (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, (dict, list)))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, (dict, list)))
    return False


def parse_json_body(body: bytes) -> dict[str, Any]:
    """Parse a request body that must be one JSON object.

    Raises ``RequestValidationError`` for invalid UTF-8, invalid JSON, ``NaN``/``Infinity`` literals
    (not JSON, although Python accepts them), nesting deeper than ``MAX_JSON_DEPTH`` (100) levels, strings
    with lone UTF-16 surrogates (``param`` names the field), or a top level that is not an object. The
    depth bound is also what keeps a body safe to pickle on its way to a prefork Celery child (about 500
    levels exhaust Python's recursion limit there and take the whole worker down).

    More than ``MAX_JSON_CONTAINERS`` (50,000) objects and arrays is refused before parsing (400, no
    ``param``): they are what makes parsed JSON many times larger than its text.

    Parsed by pydantic-core's JSON parser (jiter; about 9x faster than the standard library on a 4 MB
    image ``data:`` URL), which accepts only valid Unicode text and no ``NaN``. Any body it refuses is
    parsed again by the standard library, which gives the precise error.
    """
    containers = _json_containers(body)
    if containers > MAX_JSON_CONTAINERS:
        raise RequestValidationError(f"The request body holds more than {MAX_JSON_CONTAINERS} JSON objects and "
                                     f"arrays", None)
    try:
        data = pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError:
        data = _parse_json_body_std(body)
    else:
        if b"\xed" in body and _SURROGATE_BYTES.search(body):
            data = _parse_json_body_std(body)
    if not isinstance(data, dict):
        raise RequestValidationError("The request body must be a JSON object", None)
    if containers > MAX_JSON_DEPTH and _too_deep(data):  # nesting needs at least as many objects/arrays
        raise RequestValidationError(f"Invalid JSON body: nested too deeply (more than {MAX_JSON_DEPTH} levels)",
                                     None)
    return data


def _parse_json_body_std(body: bytes) -> Any:
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except RequestValidationError:
        raise
    except RecursionError:
        raise RequestValidationError("Invalid JSON body: nested too deeply", None) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise RequestValidationError(f"Invalid JSON body: {exc}", None) from None
    if isinstance(data, dict) and (_SURROGATE_ESCAPE.search(body) or _SURROGATE_BYTES.search(body)):
        bad = _lone_surrogate_path(data)
        if bad is not None:
            raise RequestValidationError(
                f"Invalid value for '{bad}': the string contains a lone UTF-16 surrogate, which is not valid "
                f"Unicode text", bad)
    return data


def _check_model_name(v: str | None) -> str | None:
    if v is not None and not _MODEL_NAME.fullmatch(v):
        raise ValueError("not a served model name (1-128 characters: letters, digits and . _ : / -, starting "
                         "with a letter or digit)")
    return v


def _check_request_id(v: str | None) -> str | None:
    if v is not None and _CONTROL_CHARS.search(v):
        raise ValueError("request_id must not contain control characters (it is echoed in the X-Request-Id "
                         "header)")
    return v


def _check_token_id_list(v: list[int] | None) -> list[int] | None:
    """Non-negative ids, duplicates dropped (first occurrence order kept), at most ``MAX_STOP_TOKEN_IDS``;
    ``None`` (not provided: the model's defaults apply) stays ``None``."""
    if v is None:
        return None
    if any(i < 0 for i in v):
        raise ValueError("token ids must be non-negative")
    out = list(dict.fromkeys(v))
    if len(out) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} distinct token ids are allowed")
    return out


ModelName = Annotated[str | None, Field(default=None, max_length=MAX_MODEL_NAME_LEN),
                      AfterValidator(_check_model_name)]
"""``model``: at most ``MAX_MODEL_NAME_LEN`` characters matching ``SERVED_MODEL_NAME_RE``, or null."""
RequestId = Annotated[str | None, Field(default=None, max_length=MAX_REQUEST_ID_LEN),
                      AfterValidator(_check_request_id)]
"""A client ``request_id``: at most ``MAX_REQUEST_ID_LEN`` characters, no control characters, or null."""
TokenIdList = Annotated[list[int] | None, Field(default=None, max_length=16 * MAX_STOP_TOKEN_IDS),
                        AfterValidator(_check_token_id_list)]
"""``stop_token_ids`` / ``eos_token_ids``: see ``_check_token_id_list`` (a list longer than 16x the cap is
refused before the duplicates are even looked at)."""


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, populate_by_name=True)


class StreamOptions(_Base):
    """``stream_options``: ``include_usage`` adds a final usage chunk (OpenAI); with it, ``continuous_usage_stats``
    (vLLM's extension) puts the usage so far on every chunk."""

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
    """A tool's function: ``name`` as OpenAI allows it (1-64 of a-z, A-Z, 0-9, ``_``, ``-``): the name is written
    into the rendered prompt, so quotes, newlines or a special token's text in it would be the template's markup."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"] = "function"
    function: FunctionDefinition


# chat_template_kwargs policy (conformance C35): the keys the template may not see are refused; keys with a
# known meaning must have their type; any other key is passed to the template (which ignores keys it does not
# reference) but only with a JSON scalar value, so a request cannot smuggle structures into a template.
_RESERVED_TEMPLATE_KWARGS = ("chat_template", "tokenize", "messages", "tools", "documents",
                             "add_generation_prompt", "continue_final_message")
_TYPED_TEMPLATE_KWARGS: dict[str, tuple[type, ...]] = {
    "enable_thinking": (bool,), "thinking": (bool,), "reasoning_effort": (str,), "add_vision_id": (bool,),
    "keep_cot": (bool,),
}
MAX_TEMPLATE_KWARGS = 32


def check_chat_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """Validate ``chat_template_kwargs`` (policy above). Raises ``RequestValidationError`` (param
    ``chat_template_kwargs`` or ``chat_template_kwargs.<key>``)."""
    if not kwargs:
        return
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise RequestValidationError(f"chat_template_kwargs may hold at most {MAX_TEMPLATE_KWARGS} keys",
                                     "chat_template_kwargs")
    for key, value in kwargs.items():
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise RequestValidationError(
                f"chat_template_kwargs must not contain {key!r}"
                + (": client-supplied chat templates are refused" if key == "chat_template" else ""),
                "chat_template_kwargs")
        want = _TYPED_TEMPLATE_KWARGS.get(key)
        if want is not None:
            if type(value) not in want and value is not None:
                raise RequestValidationError(
                    f"chat_template_kwargs.{key} must be a {want[0].__name__}, got {type(value).__name__}",
                    f"chat_template_kwargs.{key}")
        elif value is not None and type(value) not in (str, int, float, bool):
            raise RequestValidationError(
                f"chat_template_kwargs.{key} must be a string, number or boolean", f"chat_template_kwargs.{key}")


def check_tools(tools: list[ChatTool] | None, tool_choice: Any) -> None:
    """Validate ``tools`` against ``tool_choice`` (OpenAI rules, vLLM's ``ChatCompletionRequest``).

    ``tool_choice``: ``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "function":
    {"name": ...}}``; anything but ``"none"`` needs ``tools``; a named choice must name one of them; tool
    names must be unique. ``"required"`` and a named choice are enforced by a JSON-schema constraint on the
    output (``inference.tool_parsers.forced``).
    """
    if tools is not None and len(tools) == 0:
        raise RequestValidationError("tools must not be an empty array", "tools")
    names = [t.function.name for t in tools or []]
    if len(set(names)) != len(names):
        raise RequestValidationError("tool function names must be unique", "tools")
    if tool_choice is None:
        return
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise RequestValidationError(
                f"tool_choice must be 'none', 'auto', 'required' or a function object, got {tool_choice!r}",
                "tool_choice")
        if tool_choice != "none" and not tools:
            raise RequestValidationError(f"tool_choice {tool_choice!r} requires 'tools'", "tool_choice")
        return
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestValidationError(
            "tool_choice object must be {'type': 'function', 'function': {'name': <tool name>}}", "tool_choice")
    if not tools:
        raise RequestValidationError("a named tool_choice requires 'tools'", "tool_choice")
    if fn["name"] not in names:
        raise RequestValidationError(f"tool_choice names {fn['name']!r}, which is not one of the tools {names}",
                                     "tool_choice")


def check_history_tool_calls(messages: list[ChatMessage]) -> None:
    """Every ``messages[i].tool_calls[j].function.arguments`` given as a string must be a JSON object (OpenAI
    sends the model's arguments as a JSON object string). Anything else is a 400 naming that field, where vLLM
    (and this server before) silently rendered ``{}``: the model would see a call its client never made."""
    for i, message in enumerate(messages):
        for j, call in enumerate(message.tool_calls or []):
            args = call.function.arguments
            if not isinstance(args, str):
                continue
            try:
                value = json.loads(args)
            except ValueError:
                value = None
            if not isinstance(value, dict):
                raise RequestValidationError(
                    f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object encoded as a "
                    f"string (e.g. '{{\"city\": \"Paris\"}}'), got {args[:80]!r}",
                    f"messages[{i}].tool_calls[{j}].function.arguments")


class JsonSchemaFormat(_Base):
    """``response_format.json_schema`` (OpenAI): ``name`` (1-64 of a-z, A-Z, 0-9, ``_``, ``-``), ``schema`` (a
    JSON schema object, required here: without one there is nothing to constrain to), ``description`` and
    ``strict`` (accepted; the schema is always enforced, as with ``strict: true``)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Base):
    """``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON object) or
    ``{"type": "json_schema", "json_schema": {...}}`` (OpenAI; vLLM's ``structural_tag`` shapes are refused)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise RequestValidationError("response_format of type 'json_schema' requires 'json_schema'",
                                         "response_format.json_schema")
        return self


class StructuredOutputs(_Base):
    """vLLM's ``structured_outputs`` request extension (``StructuredOutputsParams``): exactly one of ``json`` (a JSON
    schema, as an object or as JSON text), ``regex``, ``choice`` (list of strings), ``grammar`` (Lark or GBNF) and
    ``json_object`` (true: any JSON object). vLLM's other keys (backend options, ``structural_tag``) are not
    supported; unknown keys are ignored, as every body's."""

    json_: Any = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name, value in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                          ("grammar", self.grammar), ("json_object", self.json_object))
                 if value is not None]
        if len(given) != 1:
            raise RequestValidationError(
                "structured_outputs must hold exactly one of 'json', 'regex', 'choice', 'grammar' and "
                f"'json_object'; got {len(given)}" + (f" ({', '.join(given)})" if given else ""),
                "structured_outputs")
        if self.json_ is not None and not isinstance(self.json_, (str, dict)):
            raise RequestValidationError("structured_outputs.json must be a JSON schema (an object or its JSON "
                                         "text)", "structured_outputs.json")
        if self.json_object is False:
            raise RequestValidationError("structured_outputs.json_object must be true when given",
                                         "structured_outputs.json_object")
        return self


class _SamplingFields(_Base):
    """Sampling fields shared by chat and completions (OpenAI + vLLM extensions)."""

    model: ModelName = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: TokenIdList = None
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
    request_id: RequestId = None
    # vLLM's ``cache_salt`` (``vllm/entrypoints/openai/protocol.py``: a non-empty string when given): salts the
    # prefix cache so only requests with the same salt share cached prefixes. Here it narrows sharing further
    # within the caller's cache group; it never replaces the tenant salt the gateway adds.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # vLLM's ``priority`` (lower = earlier). Here the priority tier comes from the API key's tenant; this field
    # can only order the request later within that tier (0 = the tier's first), so it is ≥ 0: a client cannot
    # raise its own priority (``inference.api.admission.engine_priority``).
    priority: int | None = Field(
        default=0, ge=0, le=2**31 - 1,
        description="Orders the request later within its priority tier (0 = earliest). The tier itself is set by "
                    "the operator for the API key's tenant; a request cannot raise it.")
    return_token_ids: bool | None = False
    # Structured outputs (the engine masks the logits to a grammar, ``inference.shared.structured``): OpenAI's
    # ``response_format`` and vLLM's ``structured_outputs`` request extension; not both.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

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
        if any(len(s) > MAX_STOP_STRING_LEN for s in items):
            raise ValueError(f"stop sequences may be at most {MAX_STOP_STRING_LEN} characters long")
        return items

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _count_logit_bias(cls, v: Any) -> Any:
        # before pydantic copies the mapping: an over-cap one is refused without building anything
        if isinstance(v, dict) and len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries")
        return v

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
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}") from None
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {key}")
        return v

    @model_validator(mode="after")
    def _check_cross(self) -> _SamplingFields:
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise RequestValidationError("Send either response_format or structured_outputs, not both",
                                         "structured_outputs")
        if self.stream_options is not None and not self.stream:
            if self.stream_options.include_usage or self.stream_options.continuous_usage_stats:
                raise RequestValidationError("stream_options can only be set when stream is true",
                                             "stream_options")
        if self.n and self.n > 1 and self.temperature is not None and self.temperature < 1e-5:
            raise RequestValidationError("n must be 1 when using greedy sampling (temperature 0)", "n")
        return self


class _ChatTemplateFields(_Base):
    """Fields and checks every chat-style body shares (chat completions, ``/tokenize``, render): the messages
    and the template arguments (vLLM's ``ChatCompletionRequest``, conformance C02, C06, C35)."""

    model: ModelName = None
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_DOCUMENTS)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must contain at least one message")
        parts = sum(len(m.content) for m in v if isinstance(m.content, list))
        if parts > MAX_CONTENT_PARTS:
            raise ValueError(f"messages may hold at most {MAX_CONTENT_PARTS} content parts in all, got {parts}")
        return v

    @model_validator(mode="after")
    def _check_template_args(self) -> _ChatTemplateFields:
        if self.add_generation_prompt and self.continue_final_message and \
                "add_generation_prompt" in self.model_fields_set:
            raise RequestValidationError(
                "continue_final_message and add_generation_prompt cannot both be true: continue the final "
                "assistant message or start a new one, not both", "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise RequestValidationError(
                "continue_final_message requires the last message to be from the assistant",
                "continue_final_message")
        check_chat_template_kwargs(self.chat_template_kwargs)
        check_history_tool_calls(self.messages)
        return self


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    """``POST /v1/chat/completions`` body (OpenAI chat API plus vLLM's templating extensions)."""

    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    parallel_tool_calls: bool | None = True
    echo: bool | None = False

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise RequestValidationError("top_logprobs requires logprobs to be true", "top_logprobs")
        check_tools(self.tools, self.tool_choice)
        return self

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """``(value, field name)`` of the client's output cap: ``max_completion_tokens`` wins."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def echo_text(self) -> str:
        """What ``echo`` puts before each choice's content: the last message's text when it is the assistant's (the
        prefix ``continue_final_message`` continues; vLLM echoes the last message when its role is the reply's), its
        text parts joined by newlines as the template gets them; ``""`` without ``echo`` or such a message."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant" or not last.content:
            return ""
        if isinstance(last.content, str):
            return last.content
        return "\n".join(p["text"] for p in last.content if isinstance(p.get("text"), str))


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body. ``prompt``: a string, a list of token ids, or a list of strings or of
    token-id lists (OpenAI's batch form; vLLM caps it at ``MAX_COMPLETION_PROMPTS``). A list holding one prompt is
    that prompt. A batch of ``P`` prompts asks for ``P × n`` choices (at most ``MAX_COMPLETION_PROMPTS``), choice
    ``i × n + j`` being the ``j``-th of prompt ``i`` (OpenAI and vLLM's order); ``prompts`` gives the list.
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = False
    add_special_tokens: bool | None = True
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:  # fill-in-the-middle needs a model-specific prompt format this server does not have
            raise ValueError("suffix (fill-in-the-middle) is not supported by this server")
        return v

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in v):
            if any(x < 0 for x in v):
                raise ValueError("prompt token ids must be non-negative")
            return v
        if len(v) > MAX_COMPLETION_PROMPTS:
            raise ValueError(f"prompt holds {len(v)} prompts; at most {MAX_COMPLETION_PROMPTS} per request")
        for i, inner in enumerate(v):
            where = "prompt" if len(v) == 1 else f"prompt {i}"
            if isinstance(inner, list) and len(inner) == 0:
                raise ValueError(f"{where} must not be empty")
            if isinstance(inner, list) and any(x < 0 for x in inner):
                raise ValueError(f"{where}: token ids must be non-negative")
        return v[0] if len(v) == 1 else v

    @model_validator(mode="after")
    def _check_choices(self) -> CompletionRequest:
        if self.is_batch and len(self.prompts) * (self.n or 1) > MAX_COMPLETION_PROMPTS:
            raise RequestValidationError(
                f"{len(self.prompts)} prompts with n={self.n} ask for {len(self.prompts) * (self.n or 1)} choices; "
                f"at most {MAX_COMPLETION_PROMPTS} per request", "n")
        return self

    @property
    def is_batch(self) -> bool:
        """True when ``prompt`` holds two or more prompts (a list of strings or of token-id lists)."""
        return isinstance(self.prompt, list) and bool(self.prompt) and not isinstance(self.prompt[0], int)

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts in order, each a string or a list of token ids (one for a single prompt)."""
        if self.is_batch:
            return list(self.prompt)  # type: ignore[arg-type]
        return [self.prompt]  # type: ignore[list-item]

    @model_validator(mode="after")
    def _check_max_tokens_pair(self) -> CompletionRequest:
        # OpenAI's chat field on the legacy endpoint (vLLM accepts both names); two different caps are ambiguous
        if self.max_completion_tokens is not None and "max_tokens" in self.model_fields_set \
                and self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise RequestValidationError(
                f"max_tokens ({self.max_tokens}) and max_completion_tokens ({self.max_completion_tokens}) are "
                f"both given and differ: send one of them", "max_completion_tokens")
        return self

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """``(value, field name)`` of the output cap: ``max_completion_tokens`` when given (as on chat), else
        ``max_tokens``; ``null`` or omitted means the OpenAI default of 16."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return (16 if self.max_tokens is None else self.max_tokens), "max_tokens"


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in {"function-after"}))]
    # pydantic adds union-member names such as 'str' or 'list[int]' to the location: drop them
    cleaned = [p for p in parts if p not in {"str", "int", "float", "bool", "list", "dict", "list[int]",
                                             "list[str]", "list[list[int]]", "list[dict[str,any]]"}]
    return ".".join(cleaned) if cleaned else None


def validate_request(model_cls: type[BaseModel], data: dict[str, Any]) -> Any:
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


# ----------------------------------------------------------------------------- /tokenize, /detokenize


class TokenizeCompletionRequest(_Base):
    """``POST /tokenize`` with a completion-style body (vLLM's ``vllm/entrypoints/serve/tokenize/protocol.py``)."""

    model: ModelName = None
    prompt: str
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_ChatTemplateFields):
    """``POST /tokenize`` with a chat-style body: the same template arguments as chat completions."""

    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _check_tools(self) -> TokenizeChatRequest:
        if self.tools is not None and len(self.tools) == 0:
            self.tools = None  # vLLM: an empty tools list is allowed on /tokenize
        check_tools(self.tools, self.tool_choice if self.tool_choice != "required" else "auto")
        return self


def tokenize_request_class(data: dict[str, Any]) -> type[_Base]:
    """The /tokenize schema for ``data``: chat when it has ``messages``, else completion. Both at once is
    ambiguous: ``RequestValidationError``."""
    if "messages" in data and "prompt" in data:
        raise RequestValidationError("Send either 'messages' (a chat) or 'prompt' (a completion), not both",
                                     "prompt")
    return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest


class DetokenizeRequest(_Base):
    """``POST /detokenize``: ``{"model", "tokens": [int, ...]}`` → ``{"prompt": str}``."""

    model: ModelName = None
    tokens: list[int]
    skip_special_tokens: bool | None = False

    @field_validator("tokens")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        for i, t in enumerate(v):
            if t < 0:
                raise RequestValidationError(f"token id {t} at index {i} is out of vocabulary (negative)",
                                             "tokens")
        return v


# ----------------------------------------------------------------------------- tokens in, tokens out


class GenerateSamplingParams(_Base):
    """``sampling_params`` of ``POST /inference/v1/generate`` (what the render routes return).

    Engine fields (``inference.protocol.engine.SamplingParams``) with the same ranges as the OpenAI fields,
    plus the frontend-applied ``n``, ``stop``, ``include_stop_str_in_output`` and ``skip_special_tokens``, and
    vLLM's ``structured_outputs`` (as on chat; what the render routes return for a constrained request).
    ``max_tokens`` omitted → the room left in the context.
    """

    n: int | None = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=0, ge=-1, le=1_000_000)
    min_p: float | None = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int | None = Field(default=0, ge=0)
    stop_token_ids: TokenIdList = None
    eos_token_ids: TokenIdList = None
    ignore_eos: bool | None = False
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    structured_outputs: StructuredOutputs | None = None

    # the same validators as the sampling fields' (the classmethods' functions, re-registered here)
    _check_stop = field_validator("stop")(_SamplingFields._check_stop.__func__)  # type: ignore[attr-defined]
    _count_logit_bias = field_validator("logit_bias", mode="before")(
        _SamplingFields._count_logit_bias.__func__)  # type: ignore[attr-defined]
    _check_logit_bias = field_validator("logit_bias")(
        _SamplingFields._check_logit_bias.__func__)  # type: ignore[attr-defined]

    @model_validator(mode="after")
    def _check_greedy_n(self) -> GenerateSamplingParams:
        if (self.n or 1) > 1 and self.temperature is not None and self.temperature < 1e-5:
            raise RequestValidationError("n must be 1 when using greedy sampling (temperature 0)",
                                         "sampling_params.n")
        return self

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """``(value, field name)`` of the output cap, as chat and completions requests give it (``max_tokens``; None:
        the room left beside the prompt)."""
        return self.max_tokens, "max_tokens"


class GenerateRequest(_Base):
    """``POST /inference/v1/generate`` body (vLLM's ``GenerateRequest``, text-only subset)."""

    model: ModelName = None
    request_id: RequestId = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @field_validator("token_ids")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        for i, t in enumerate(v):
            if t < 0:
                raise RequestValidationError(f"token id {t} at index {i} is out of vocabulary (negative)",
                                             "token_ids")
        return v


class AbortRequestsRequest(_Base):
    """``POST /inference/v1/abort_requests``: ``{"request_ids": [str, ...]}``."""

    request_ids: list[Annotated[str, Field(max_length=MAX_REQUEST_ID_LEN + 64)]] = Field(max_length=1024)
