"""``tool_choice: "required"`` and a named function: the output is constrained by a JSON schema (the engine's
structured-output mask), then read back as calls. The schemas are vLLM's
(``vllm/entrypoints/openai/protocol.py::_get_json_schema_from_tool`` / ``get_structured_outputs``):

* ``"required"`` → a JSON array (``minItems`` 1; ``maxItems`` 1 when ``parallel_tool_calls`` is false) of
  ``{"name": <const>, "parameters": <the tool's parameters schema>}`` objects, ``anyOf`` the tools;
* a named function → that tool's ``parameters`` schema itself (the output is the arguments object).

A tool without ``parameters`` takes ``EMPTY_PARAMETERS``, an object with no keys at all: OpenAI reads an omitted
``parameters`` as a function of no arguments, so the only arguments a forced call may have are ``{}`` (an open
``{"type": "object"}`` would let a model write made-up keys until ``max_tokens`` and never finish the call).
"""

from __future__ import annotations

import json
from typing import Any

from inference.shared.markers import TextBuffer
from inference.protocol.openai import RequestValidationError
from inference.shared.structured import Constraint, schema_constraint
from inference.tool_parsers.base import ParsedToolCall, ToolParseDelta, ToolParser, call_from_obj

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def _parameters(tool: Any) -> dict[str, Any]:
    params = tool.function.parameters
    return dict(params) if params else dict(EMPTY_PARAMETERS)


def rebased(schema: Any, base: str) -> Any:
    """A copy of ``schema`` whose local JSON-pointer ``$ref`` s (``#`` and ``#/...``) point into the document it is
    embedded in at ``base`` (a JSON pointer, e.g. ``/items/anyOf/0/properties/parameters``): a tool's ``parameters``
    that uses ``$defs`` keeps resolving once placed inside the ``"required"`` schema. Other refs (anchors, remote) are
    left as they are. Iterative: the depth is bounded by the caps, not by the recursion limit."""
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(schema, root, 0)]
    while stack:
        value, parent, key = stack.pop()
        if isinstance(value, dict):
            copy: Any = dict.fromkeys(value)  # the keys in their order (it is the order the output's keys take)
            for k, v in value.items():
                if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
                    copy[k] = "#" + base + v[1:]
                else:
                    stack.append((v, copy, k))
        elif isinstance(value, list):
            copy = [None] * len(value)
            stack.extend((v, copy, i) for i, v in enumerate(value))
        else:
            copy = value
        parent[key] = copy
    return root[0]


def forced_tool_name(tool_choice: Any) -> str | None:
    """The function name of a named ``tool_choice`` (``{"type": "function", "function": {"name": ...}}``)."""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str):
            return name
    return None


def tool_choice_schema(tools: list[Any], tool_choice: Any, parallel_tool_calls: bool) -> dict[str, Any] | None:
    """The JSON schema that forces ``tool_choice`` (module docstring), ``None`` for ``"auto"``/``"none"``/absent.
    Unlike vLLM's, a call object admits no keys beyond ``name`` and ``parameters`` (JSON Schema allows extra keys by
    default: a model could then write an endless made-up key, which no client reads as a call), and a tool's local
    ``$ref`` s are rebased to where its ``parameters`` sit in the ``"required"`` schema (``rebased``; vLLM leaves them
    pointing at the root, where its ``$defs`` are not).
    ``tools``: the request's validated ``ChatTool`` s (``check_tools`` already ensured a named tool exists)."""
    if tool_choice == "required":
        items = [{"properties": {"name": {"type": "string", "enum": [t.function.name]},
                                 "parameters": rebased(_parameters(t), f"/items/anyOf/{i}/properties/parameters")},
                  "required": ["name", "parameters"], "additionalProperties": False} for i, t in enumerate(tools)]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return schema
    name = forced_tool_name(tool_choice)
    if name is None:
        return None
    return next(_parameters(t) for t in tools if t.function.name == name)


class _WholeOutputParser(ToolParser):
    """A forced choice's parser: the output is one JSON value, read whole at the end (``calls_of``); a value that
    does not parse, or is not what the choice forces (cut short by ``max_tokens``), is content as written. The
    text is kept in a ``TextBuffer``, joined once at ``flush`` (O(output) in all, not a copy per delta)."""

    def __init__(self) -> None:
        self._text = TextBuffer()

    def push(self, text: str) -> ToolParseDelta:
        self._text.append(text)
        return ToolParseDelta()

    def flush(self) -> ToolParseDelta:
        text, self._text = self._text.text(), TextBuffer()
        try:
            calls = self.calls_of(json.loads(text))
        except (ValueError, RecursionError):  # not JSON, or nested past the decoder's depth (a recursive schema)
            return ToolParseDelta(content=text)
        return ToolParseDelta(calls=calls) if calls is not None else ToolParseDelta(content=text)

    def calls_of(self, value: Any) -> list[ParsedToolCall] | None:  # pragma: no cover - abstract
        """The calls ``value`` (the parsed output) holds, or ``None`` when it is not the forced shape."""
        raise NotImplementedError


class RequiredToolParser(_WholeOutputParser):
    """Reads the ``"required"`` array of ``{"name", "parameters"}`` calls."""

    name = "forced_required"

    def calls_of(self, value: Any) -> list[ParsedToolCall] | None:
        if not isinstance(value, list) or not value:
            return None
        calls = [call_from_obj(item, args_keys=("parameters",), args_required=True) for item in value]
        return None if any(c is None for c in calls) else [c for c in calls if c is not None]


class NamedToolParser(_WholeOutputParser):
    """Reads the named function's arguments object."""

    name = "forced_named"

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def calls_of(self, value: Any) -> list[ParsedToolCall] | None:
        if not isinstance(value, dict):
            return None
        return [ParsedToolCall(self.function_name, json.dumps(value, ensure_ascii=False))]


def tool_choice_constraint(req: Any) -> Constraint | None:
    """The constraint of a chat request's ``tool_choice`` (``None`` unless ``"required"`` or named): kind ``"json"``,
    the schema's JSON text, ``param`` the field a bad schema came from (``tools[i].function.parameters`` for a named
    tool, ``tools`` for ``"required"``). The gateway compiles it in its grammar sandbox like any client schema (a
    tool's ``parameters`` is client text) and sets ``after_token_ids`` from the reasoning parser.

    Raises ``RequestValidationError`` (param ``tool_choice``) when the request also asks for another output
    constraint (``response_format`` other than ``text``, ``structured_outputs``): one output cannot follow two
    schemas, and vLLM refuses ``structured_outputs`` with a named tool too (D-124).
    """
    tools = req.tools or []
    schema = tool_choice_schema(tools, req.tool_choice, req.parallel_tool_calls is not False)
    if schema is None:
        return None
    response_format = getattr(req, "response_format", None)
    rf_type = response_format.get("type", "text") if isinstance(response_format, dict) \
        else getattr(response_format, "type", "text")
    if (response_format is not None and rf_type != "text") or getattr(req, "structured_outputs", None):
        raise RequestValidationError(
            "tool_choice 'required' or a named function constrains the output to tool calls; it cannot be "
            "combined with response_format or structured_outputs", "tool_choice")
    name = forced_tool_name(req.tool_choice)
    param = "tools" if name is None else \
        f"tools[{next(i for i, t in enumerate(tools) if t.function.name == name)}].function.parameters"
    return schema_constraint(schema, param)
