"""Structured outputs, the torch-free half: a request's constraint → ``(kind, spec)`` → an llguidance grammar.

Two sides use it, and neither runs client text through Python-side grammar code on a thread that matters:

* the gateway's grammar sandbox (``inference.api.structured_sandbox``, a separate process with a CPU-time budget) runs
  ``check``: the linear caps (``inference.shared.structured_caps``), the conversion of the client's text into its
  *engine form* (``normalize``: a GBNF grammar becomes Lark) and llguidance's validation; the request then carries
  the engine form;
* the engines compile only an engine form (``engine_grammar``: llguidance's own compile, which releases the GIL,
  bounded by ``parser_limits``), never the client's raw text: no format sniffing, no GBNF conversion, no schema walk
  on an engine thread.

llguidance (PyPI ``llguidance``, no dependencies, no torch) does the grammar work; docs/DECISIONS.md D-110 says why
it and not xgrammar.

Kinds (``inference.protocol.engine.STRUCTURED_KINDS``), the client's ``spec`` and its engine form:

=================  ==============================  ========================  ========================================
kind               client spec                     engine form               request field (OpenAI / vLLM)
=================  ==============================  ========================  ========================================
``json``           a JSON schema (JSON text)       the same text             ``response_format.json_schema.schema``,
                                                                             ``structured_outputs.json``
``json_object``    ``""`` (any JSON object)        ``""``                    ``response_format`` ``json_object``,
                                                                             ``structured_outputs.json_object``
``regex``          a regular expression (Rust      the same text             ``structured_outputs.regex``
                   ``regex`` syntax)
``choice``         a JSON list of strings          the same text             ``structured_outputs.choice``
``grammar``        a Lark grammar, or GBNF         Lark, first line          ``structured_outputs.grammar``
                   (llama.cpp)                     ``%llguidance {}``
=================  ==============================  ========================  ========================================

The engine form of a grammar starts with ``%llguidance {}``, so a consumer that sniffs the format with llguidance's
``grammar_from`` (vLLM's guidance backend) recognises it at its first character instead of scanning the text.

JSON is generated compact (no whitespace between tokens: llguidance's ``whitespace_flexible`` off, as vLLM's
``disable_any_whitespace``): a model may otherwise spend its whole budget on whitespace (D-112).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from inference.shared.config import SETTINGS
from inference.protocol.engine import STRUCTURED_KINDS
from inference.protocol.openai import RequestValidationError
from inference.shared.structured_probe import probe
from inference.shared.structured_caps import (
    LARK_HEADER,
    MAX_CHOICES,
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_BYTES,
    StructuredSpecError,
    check_grammar,
    check_regex,
    check_size,
    check_value_size,
    is_lark,
    load_choices,
    load_schema,
    ref_cycle,
)

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["ANY_OBJECT_SCHEMA", "Constraint", "LARK_HEADER", "MAX_CHOICES", "MAX_SCHEMA_DEPTH", "MAX_SPEC_BYTES",
           "NOUN", "StructuredSpecError", "check", "constraint_of", "engine_grammar", "normalize", "parser_limits",
           "ref_cycle", "schema_constraint", "spec_key"]

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
ANY_OBJECT_SCHEMA = '{"type": "object"}'


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's parser limits for every grammar here (a fresh object: the library takes it by value).

    ``max_grammar_size`` (symbols) and ``max_lexer_states`` are lowered from the library's defaults
    (500,000 / 250,000) to ``STRUCTURED_MAX_GRAMMAR_SIZE`` / ``STRUCTURED_MAX_LEXER_STATES``: a schema under
    the byte cap needs far fewer, and a lexer state costs 1-2 kB of engine memory. ``verbose_errors`` off:
    an error message is shown to the client, without the library's dump of parser state.

    ``initial_lexer_fuel`` is lowered from 1,000,000 to ``STRUCTURED_INITIAL_LEXER_FUEL`` (100,000): it bounds the
    work of a grammar's first mask (the lexer's precomputation over the token trie), which the tokenizer-free check
    cannot see; at the default a 20-byte regex ``(a{1000}){1000}`` cost the engine 0.7 s and 180 MB per request, at
    100,000 it fails in ~40 ms; ordinary constraints (e-mail, date-time and UUID patterns, schemas, a JSON GBNF) need
    under 25,000."""
    return llguidance.LLParserLimits(max_grammar_size=SETTINGS.structured_max_grammar_size,
                                     max_lexer_states=SETTINGS.structured_max_lexer_states,
                                     initial_lexer_fuel=SETTINGS.structured_initial_lexer_fuel,
                                     verbose_errors=False)


def spec_key(kind: str, spec: str, *scope: str) -> str:
    """sha256 hex of ``(kind, spec, *scope)``: the cache key of a compile result. ``scope``: who may share it (the
    caller's cache scope, a tokenizer id): a cache shared across tenants would tell one, by its timing, which
    schemas another sent."""
    h = hashlib.sha256(kind.encode())
    for part in (spec, *scope):
        h.update(b"\x00" + part.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def normalize(kind: str, spec: str) -> str:
    """The engine form of the client's constraint ``(kind, spec)`` (module docstring), within the caps of
    ``inference.shared.structured_caps``. A GBNF grammar is converted with llguidance's converter (pure Python: its
    fixpoint is quadratic in the rules, which the rule cap and the sandbox's budget bound). Raises
    ``StructuredSpecError``. Call it in the grammar sandbox, not on a shared thread."""
    if kind not in STRUCTURED_KINDS:
        raise StructuredSpecError(f"unknown structured output kind {kind!r}")
    if kind == "json":
        load_schema(spec)
        return spec
    if kind == "json_object":
        return ""
    if kind == "regex":
        check_regex(spec)
        return spec
    if kind == "choice":
        load_choices(spec)
        return spec
    check_grammar(spec)
    if is_lark(spec):
        return spec if spec.startswith(LARK_HEADER) else f"{LARK_HEADER}\n{spec}"
    try:
        lark = gbnf_to_lark(spec)
    except RecursionError:
        raise StructuredSpecError("is not a valid grammar: nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 - the converter raises bare Exception for a rule it cannot resolve
        raise StructuredSpecError(f"is not a valid grammar: the GBNF could not be converted: {exc}") from None
    return lark if lark.startswith(LARK_HEADER) else f"{LARK_HEADER}\n{lark}"


def engine_grammar(kind: str, spec: str) -> str:
    """The llguidance grammar (its serialised form, for ``LLMatcher``) of an engine-form constraint (``normalize``'s
    output): library calls in native code, plus, for a choice list, one ``json.loads``. No caps are checked here:
    the gateway checked them. Raises ``StructuredSpecError`` (unknown kind, a choice list that does not parse)."""
    if kind not in STRUCTURED_KINDS:
        raise StructuredSpecError(f"unknown structured output kind {kind!r}")
    if kind in ("json", "json_object"):
        text = spec if kind == "json" else ANY_OBJECT_SCHEMA
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise StructuredSpecError(f"is not a supported JSON schema: {exc}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except ValueError as exc:
            raise StructuredSpecError(f"is not a JSON list: {exc}") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise StructuredSpecError("must be a list of non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    return llguidance.LLMatcher.grammar_from_lark(spec)


def _first_line(message: str) -> str:
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return "; ".join(lines[:3])[:500]


def check(kind: str, spec: str) -> str:
    """Validate the client's constraint ``(kind, spec)`` as the engine will compile it and return its engine form:
    caps, conversion (``normalize``) and llguidance's grammar validation under ``parser_limits`` (grammar warnings,
    such as an unsatisfiable or partly unimplemented schema, are errors too: the engine could not keep its promise;
    except an unknown string ``format``, which is ignored, as JSON Schema says of unknown formats). Raises
    ``StructuredSpecError``. Then a dry run of its first tokens over a byte vocabulary (``structured_probe.probe``)
    refuses what the engine's matcher would give up on. Tokenizer-independent: a grammar that passes can still fail
    the engine on its tokenizer (rare; that request then finishes with an error). CPU work of up to the sandbox's budget: run it
    there (``inference.api.structured_sandbox``)."""
    check_size(spec)
    engine_form = normalize(kind, spec)
    # a client's Lark grammar is validated as written (its error messages' line numbers are the client's)
    text = spec if kind == "grammar" and engine_form == f"{LARK_HEADER}\n{spec}" else engine_form
    grammar = engine_grammar(kind, text)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=parser_limits())
    messages = [m for m in messages if is_error or not m.startswith("Unknown format")]
    if is_error or messages:
        raise StructuredSpecError(f"is not accepted: {_first_line('; '.join(messages) or 'invalid grammar')}")
    probe(engine_grammar(kind, engine_form), parser_limits())  # what the engine's matcher would give up on
    return engine_form


@dataclass(frozen=True)
class Constraint:
    """A request's structured-output constraint as the engine takes it (``SamplingParams.structured_kind`` /
    ``structured_spec`` / ``structured_after_token_ids``); ``param`` names the request field it came from (for
    errors); ``after_token_ids``: a thinking model's end-of-reasoning ids when its output starts in reasoning
    (the constraint then applies to the answer only), else empty. ``spec`` is the client's text until the gateway
    compiled it, its engine form after (``check``)."""

    kind: str
    spec: str
    param: str
    after_token_ids: tuple[int, ...] = ()

    def refusal(self, reason: str) -> RequestValidationError:
        """The 400 for this constraint refused for ``reason`` (a ``StructuredSpecError`` message), naming its field:
        e.g. ``Invalid value for 'structured_outputs.regex': the regular expression is not accepted: ...``."""
        return RequestValidationError(f"Invalid value for '{self.param}': the {NOUN[self.kind]} {reason}", self.param)


def schema_constraint(schema: Any, param: str) -> Constraint:
    """A ``json`` constraint of the schema object ``schema`` (a parsed request field) from field ``param``:
    serialised (``json.dumps``, key order kept: it is the order the output's keys take) once its size is known to
    be within the cap (``check_value_size``: a many-megabytes object is refused without serialising it). Raises
    ``RequestValidationError`` naming ``param``."""
    constraint = Constraint("json", "", param)
    try:
        check_value_size(schema)
    except StructuredSpecError as exc:
        raise constraint.refusal(str(exc)) from None
    return replace(constraint, spec=json.dumps(schema, ensure_ascii=False))


def constraint_of(req: Any) -> Constraint | None:
    """The constraint a validated chat/completions request asks for (``response_format`` or
    ``structured_outputs``, which the schema allows one of), or ``None``. No library work: the gateway's grammar
    sandbox checks it. A schema object is serialised (``schema_constraint``). Raises ``RequestValidationError`` for
    a schema object over the byte cap."""
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_object":
        return Constraint("json_object", "", "response_format")
    if rf is not None and rf.type == "json_schema":
        return schema_constraint(rf.json_schema.json_schema, "response_format.json_schema.schema")
    so = getattr(req, "structured_outputs", None)
    if so is None:
        return None
    if so.json_ is not None:
        if isinstance(so.json_, str):
            return Constraint("json", so.json_, "structured_outputs.json")
        return schema_constraint(so.json_, "structured_outputs.json")
    if so.regex is not None:
        return Constraint("regex", so.regex, "structured_outputs.regex")
    if so.choice is not None:
        return Constraint("choice", json.dumps(so.choice, ensure_ascii=False), "structured_outputs.choice")
    if so.grammar is not None:
        return Constraint("grammar", so.grammar, "structured_outputs.grammar")
    return Constraint("json_object", "", "structured_outputs.json_object")


NOUN = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regular expression",
        "choice": "choice list", "grammar": "grammar"}
