"""Structured outputs, the torch-free half: a request's constraint → ``(kind, spec)`` → an llguidance grammar.

Shared by the gateway (validation: 400 naming the field, before any stream starts) and the engine (compiling the
grammar it masks the logits with, ``inference.engine.structured``). llguidance (PyPI ``llguidance``, no
dependencies, no torch) does the grammar work; docs/DECISIONS.md D-110 says why it and not xgrammar.

Kinds (``inference.protocol.engine.STRUCTURED_KINDS``) and their ``spec`` text:

=================  ==============================================  ==========================================
kind               spec                                            request field (OpenAI / vLLM)
=================  ==============================================  ==========================================
``json``           a JSON schema (JSON text)                       ``response_format.json_schema.schema``,
                                                                   ``structured_outputs.json``
``json_object``    ``""`` (any JSON object)                        ``response_format`` ``json_object``,
                                                                   ``structured_outputs.json_object``
``regex``          a regular expression (Rust ``regex`` syntax)    ``structured_outputs.regex``
``choice``         a JSON list of strings: exactly one of them     ``structured_outputs.choice``
``grammar``        a Lark grammar, or GBNF (llama.cpp), converted  ``structured_outputs.grammar``
=================  ==============================================  ==========================================

JSON is generated compact (no whitespace between tokens: llguidance's ``whitespace_flexible`` off, as vLLM's
``disable_any_whitespace``): a model may otherwise spend its whole budget on whitespace (D-112).

Caps (``inference.config``; over one → 400 naming the field): ``STRUCTURED_MAX_SPEC_BYTES`` bytes of spec text,
``STRUCTURED_MAX_SCHEMA_DEPTH`` nesting levels of a JSON schema, ``STRUCTURED_MAX_CHOICES`` choices, and
llguidance's own parser limits (``parser_limits``: grammar size, lexer states and fuel), which also bound the
engine's compile and per-token work.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance

from inference.config import SETTINGS
from inference.protocol.engine import STRUCTURED_KINDS
from inference.protocol.openai import RequestValidationError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

MAX_SPEC_BYTES = SETTINGS.structured_max_spec_bytes
MAX_SCHEMA_DEPTH = SETTINGS.structured_max_schema_depth
MAX_CHOICES = SETTINGS.structured_max_choices
VALIDATION_CACHE_SIZE = 1024
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
ANY_OBJECT_SCHEMA = '{"type": "object"}'


class StructuredSpecError(ValueError):
    """A constraint llguidance refuses or one over a cap; the message says why (no field name: the caller
    knows which field the spec came from)."""


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's parser limits for every grammar here (a fresh object: the library takes it by value).

    ``max_grammar_size`` (symbols) and ``max_lexer_states`` are lowered from the library's defaults
    (500,000 / 250,000) to ``STRUCTURED_MAX_GRAMMAR_SIZE`` / ``STRUCTURED_MAX_LEXER_STATES``: a schema under
    the byte cap needs far fewer, and a lexer state costs 1-2 kB of engine memory. ``verbose_errors`` off:
    an error message is shown to the client, without the library's dump of parser state."""
    return llguidance.LLParserLimits(max_grammar_size=SETTINGS.structured_max_grammar_size,
                                     max_lexer_states=SETTINGS.structured_max_lexer_states,
                                     verbose_errors=False)


def spec_key(kind: str, spec: str, tokenizer_id: str = "") -> str:
    """sha256 hex of ``(kind, spec, tokenizer_id)``: the cache key of a validation or a compiled grammar."""
    h = hashlib.sha256(kind.encode())
    for part in (spec, tokenizer_id):
        h.update(b"\x00" + part.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value (objects and arrays; a scalar is 0). Iterative."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
            deepest = max(deepest, depth + 1)
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
            deepest = max(deepest, depth + 1)
    return deepest


def _check_size(spec: str) -> None:
    size = len(spec.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise StructuredSpecError(f"is {size} bytes long; at most {MAX_SPEC_BYTES} are allowed")


# keywords that describe a schema without constraining its values: a node with only these beside ``$ref`` is the
# schema it refers to
_ANNOTATIONS = frozenset({"$ref", "$defs", "definitions", "$schema", "$id", "$anchor", "$comment", "title",
                          "description", "default", "examples", "deprecated", "readOnly", "writeOnly"})


def _pointer(root: Any, ref: str) -> Any:
    """The node of ``root`` a local ``$ref`` (``#`` or ``#/a/b``, RFC 6901 escapes) names; None when it names none
    (or is not local: remote references are refused elsewhere)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def ref_cycle(schema: Any) -> str | None:
    """A chain of local ``$ref`` s in ``schema`` that comes back to where it started with no constraint on the way
    (e.g. ``{"$ref": "#"}``, or ``a → b → a`` under ``$defs``), as ``"#/$defs/a -> #/$defs/b -> #/$defs/a"``;
    None when there is none. Such a schema matches no JSON value, yet llguidance compiles it to a grammar whose
    only output is the empty string (a 200 with empty ``content``), so it is refused up front."""
    stack: list[Any] = [schema]
    seen_nodes: set[int] = set()
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict) or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        stack.extend(node.values())
        chain: list[str] = []
        current: Any = node
        while isinstance(current, dict) and isinstance(current.get("$ref"), str) and set(current) <= _ANNOTATIONS:
            ref = current["$ref"]
            if ref in chain:
                return " -> ".join([*chain[chain.index(ref):], ref])
            chain.append(ref)
            current = _pointer(schema, ref)
    return None


def grammar_for(kind: str, spec: str) -> str:
    """The llguidance grammar (its serialised form, for ``LLMatcher``) of the constraint ``(kind, spec)``.

    Checks only what building it checks (JSON parse of a schema or choice list, GBNF conversion) and the caps;
    ``check`` also runs the library's validation. Raises ``StructuredSpecError``."""
    if kind not in STRUCTURED_KINDS:
        raise StructuredSpecError(f"unknown structured output kind {kind!r}")
    _check_size(spec)
    if kind in ("json", "json_object"):
        text = spec if kind == "json" else ANY_OBJECT_SCHEMA
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise StructuredSpecError(f"is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise StructuredSpecError("must be a JSON object (a JSON schema)")
        depth = _depth(schema)
        if depth > MAX_SCHEMA_DEPTH:
            raise StructuredSpecError(f"nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed")
        cycle = ref_cycle(schema)
        if cycle is not None:
            raise StructuredSpecError(f"refers to itself with nothing in between ({cycle}): no JSON value matches it")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise StructuredSpecError(f"is not a supported JSON schema: {exc}") from None
    if kind == "regex":
        if not spec:
            raise StructuredSpecError("must not be empty")
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except ValueError as exc:
            raise StructuredSpecError(f"is not a JSON list: {exc}") from None
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise StructuredSpecError("must be a list of strings")
        if not choices:
            raise StructuredSpecError("must hold at least one choice")
        if len(choices) > MAX_CHOICES:
            raise StructuredSpecError(f"holds {len(choices)} choices; at most {MAX_CHOICES} are allowed")
        if any(c == "" for c in choices):
            raise StructuredSpecError("must not hold an empty string")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if not spec.strip():
        raise StructuredSpecError("must not be empty")
    try:  # Lark as is; GBNF (``root ::= ...``) converted to Lark
        return llguidance.grammar_from("grammar", spec)
    except ValueError as exc:
        raise StructuredSpecError(f"is not a valid grammar: {exc}") from None


def _first_line(message: str) -> str:
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return "; ".join(lines[:3])[:500]


def check(kind: str, spec: str) -> None:
    """Validate the constraint ``(kind, spec)`` as the engine will compile it: caps, parse, and llguidance's
    grammar validation under ``parser_limits`` (grammar warnings, such as an unsatisfiable or partly
    unimplemented schema, are errors too: the engine could not keep its promise; except an unknown string
    ``format``, which is ignored, as JSON Schema says of unknown formats). Raises
    ``StructuredSpecError``. Tokenizer-independent: a grammar that passes can still fail the engine's compile
    on its tokenizer (rare; that request then finishes with an error)."""
    grammar = grammar_for(kind, spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=parser_limits())
    messages = [m for m in messages if is_error or not m.startswith("Unknown format")]
    if is_error or messages:
        raise StructuredSpecError(f"is not accepted: {_first_line('; '.join(messages) or 'invalid grammar')}")


class _ResultCache:
    """A thread-safe LRU of validation results (``None`` = valid, else the error message) by ``spec_key``."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[str, str | None] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[bool, str | None]:
        with self._lock:
            if key not in self._items:
                return False, None
            self._items.move_to_end(key)
            return True, self._items[key]

    def put(self, key: str, value: str | None) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


_VALIDATED = _ResultCache(VALIDATION_CACHE_SIZE)


def check_cached(kind: str, spec: str) -> None:
    """``check`` with its result (valid, or the error message) remembered by ``spec_key``: a client sending the
    same schema on every request pays the validation once per process. Raises ``StructuredSpecError``."""
    key = spec_key(kind, spec)
    hit, error = _VALIDATED.get(key)
    if not hit:
        try:
            check(kind, spec)
            error = None
        except StructuredSpecError as exc:
            error = str(exc)
        _VALIDATED.put(key, error)
    if error is not None:
        raise StructuredSpecError(error)


def is_cached(kind: str, spec: str) -> bool:
    """Whether ``check_cached`` knows ``(kind, spec)`` already (a dict lookup: callers may skip the thread)."""
    return _VALIDATED.get(spec_key(kind, spec))[0]


@dataclass(frozen=True)
class Constraint:
    """A request's structured-output constraint as the engine takes it (``SamplingParams.structured_kind`` /
    ``structured_spec`` / ``structured_after_token_ids``); ``param`` names the request field it came from (for
    errors); ``after_token_ids``: a thinking model's end-of-reasoning ids when its output starts in reasoning
    (the constraint then applies to the answer only), else empty."""

    kind: str
    spec: str
    param: str
    after_token_ids: tuple[int, ...] = ()


def constraint_of(req: Any) -> Constraint | None:
    """The constraint a validated chat/completions request asks for (``response_format`` or
    ``structured_outputs``, which the schema allows one of), or ``None``. No library work: ``resolve`` checks it.
    Serialises a schema object (``json.dumps``, key order kept: it is the order the output's keys take)."""
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_object":
        return Constraint("json_object", "", "response_format")
    if rf is not None and rf.type == "json_schema":
        return Constraint("json", json.dumps(rf.json_schema.json_schema, ensure_ascii=False),
                          "response_format.json_schema.schema")
    so = getattr(req, "structured_outputs", None)
    if so is None:
        return None
    if so.json_ is not None:
        spec = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_, ensure_ascii=False)
        return Constraint("json", spec, "structured_outputs.json")
    if so.regex is not None:
        return Constraint("regex", so.regex, "structured_outputs.regex")
    if so.choice is not None:
        return Constraint("choice", json.dumps(so.choice, ensure_ascii=False), "structured_outputs.choice")
    if so.grammar is not None:
        return Constraint("grammar", so.grammar, "structured_outputs.grammar")
    return Constraint("json_object", "", "structured_outputs.json_object")


def resolve(req: Any) -> Constraint | None:
    """``constraint_of(req)``, validated (``check_cached``). Raises ``RequestValidationError`` (400) naming the
    field, e.g. ``Invalid value for 'structured_outputs.regex': is not accepted: ...``. CPU work of up to
    milliseconds for a new schema (the serialisation and llguidance's validation): call it off the event loop."""
    constraint = constraint_of(req)
    if constraint is None:
        return None
    try:
        check_cached(constraint.kind, constraint.spec)
    except StructuredSpecError as exc:
        raise RequestValidationError(f"Invalid value for '{constraint.param}': the {_NOUN[constraint.kind]} {exc}",
                                     constraint.param) from None
    return constraint


_NOUN = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regular expression",
         "choice": "choice list", "grammar": "grammar"}
