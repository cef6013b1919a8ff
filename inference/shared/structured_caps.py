"""Linear-time checks of a client's constraint text, before any grammar library sees it (issue 39).

Pure Python and the standard library: no llguidance, no torch. Every function here costs time linear in the text
it reads (one pass, or a regular expression that cannot backtrack more than once over a character), so it may run
on any thread; whatever it lets through then goes to a compile with a CPU-time budget
(``inference.api.structured_sandbox``). Caps (``inference.shared.config``; over one → ``StructuredSpecError``, which the
gateway turns into a 400 naming the field):

=======================================  =========================================================================
cap                                      what it bounds
=======================================  =========================================================================
``STRUCTURED_MAX_SPEC_BYTES``            UTF-8 bytes of any constraint text
``STRUCTURED_MAX_GRAMMAR_LINES``         lines of a grammar (llguidance's format sniffing and its GBNF converter
                                         work per line)
``STRUCTURED_MAX_GRAMMAR_RULES``         rule definitions of a grammar (the GBNF converter's fixpoint is
                                         quadratic in them)
``STRUCTURED_MAX_NESTING``               nested parentheses of a grammar or regular expression (the converter
                                         recurses per level)
``STRUCTURED_MAX_SCHEMA_DEPTH``          nesting of a JSON schema (objects and arrays)
``STRUCTURED_MAX_SCHEMA_REFS``           ``$ref`` s of a JSON schema
``STRUCTURED_MAX_SCHEMA_DEFS``           entries under ``$defs`` / ``definitions``
``STRUCTURED_MAX_CHOICES``               entries of a choice list
=======================================  =========================================================================
"""

from __future__ import annotations

import json
import re
from typing import Any

from inference.shared.config import SETTINGS

MAX_SPEC_BYTES = SETTINGS.structured_max_spec_bytes
MAX_SCHEMA_DEPTH = SETTINGS.structured_max_schema_depth
MAX_CHOICES = SETTINGS.structured_max_choices
MAX_GRAMMAR_LINES = SETTINGS.structured_max_grammar_lines
MAX_GRAMMAR_RULES = SETTINGS.structured_max_grammar_rules
MAX_NESTING = SETTINGS.structured_max_nesting
MAX_SCHEMA_REFS = SETTINGS.structured_max_schema_refs
MAX_SCHEMA_DEFS = SETTINGS.structured_max_schema_defs


# the first line of every grammar's engine form (``inference.shared.structured.normalize``): Lark with llguidance's options,
# recognised as Lark at the first character by any format sniffing (vLLM's guidance backend runs llguidance's)
LARK_HEADER = "%llguidance {}"


class StructuredSpecError(ValueError):
    """A constraint over a cap, or one the grammar library refuses; the message says why (no field name: the
    caller knows which field the spec came from)."""


def check_size(spec: str) -> None:
    """Refuse ``spec`` over ``STRUCTURED_MAX_SPEC_BYTES`` UTF-8 bytes. Raises ``StructuredSpecError``."""
    size = len(spec.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise StructuredSpecError(f"is {size} bytes long; at most {MAX_SPEC_BYTES} are allowed")


# A rule definition at a line's start: GBNF ``name ::= ...``, Lark ``name: ...`` / ``?name.2: ...`` / ``NAME: ...``.
# The name class and the blanks after it are disjoint from ``:``, so a failed line costs one pass over its name.
_RULE = re.compile(r"(?m)^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_.-]*[ \t]*(?:::=|:)")
# What cannot open or close a group: string literals, character classes and comments (GBNF ``#``, Lark ``//``),
# with backslash escapes. Disjoint alternatives, each a single pass: linear.
_OPAQUE = re.compile(r'"(?:[^"\\\n]|\\.)*"|\[(?:[^\]\\\n]|\\.)*\]|//[^\n]*|#[^\n]*')
_REGEX_OPAQUE = re.compile(r"\\.|\[(?:[^\]\\]|\\.)*\]", re.DOTALL)
_PARENS = re.compile(r"[()]")
# llguidance's test for "this grammar is Lark already" is ``(?m)^\s*(%llguidance\b|start\s*:)``, whose ``\s*`` runs
# over newlines from every line start: quadratic in a run of blank lines (1.7 s for 9,000 of them, GIL held). The
# same language, anchored at the last newline before the keyword (blanks between cannot hold a newline): linear.
_LARK = re.compile(r"(?:\A|\n)[^\S\n]*(?:%llguidance\b|start\s*:)")


def max_nesting(text: str, opaque: re.Pattern[str]) -> int:
    """The deepest nesting of parentheses in ``text`` once ``opaque`` matches (literals, classes, comments) are
    removed; a ``)`` with nothing open is ignored. Linear."""
    depth = deepest = 0
    for m in _PARENS.finditer(opaque.sub("", text)):
        if m.group() == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif depth:
            depth -= 1
    return deepest


def is_lark(text: str) -> bool:
    """Whether grammar ``text`` is Lark (llguidance's syntax) rather than GBNF: a line that starts (after blanks)
    with ``%llguidance`` or defines ``start``; the same answer as llguidance's own test, in linear time."""
    return _LARK.search(text) is not None


# a JSON schema embedded in a Lark grammar (llguidance's ``%json { ... }``), and what may open, close or quote in it
_JSON_BLOCK = re.compile(r"%json\b\s*")
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[{}]')


def json_blocks(text: str) -> list[str]:
    """The JSON schemas embedded in Lark grammar ``text`` with ``%json { ... }``, as text (an unbalanced one runs to
    the end: the library refuses it). Linear: the scan resumes after each block."""
    blocks: list[str] = []
    pos = 0
    while (m := _JSON_BLOCK.search(text, pos)) is not None:
        start = pos = m.end()
        if not text.startswith("{", start):
            continue
        depth, end = 0, len(text)
        for tok in _JSON_TOKENS.finditer(text, start):
            if tok.group() == "{":
                depth += 1
            elif tok.group() == "}":
                depth -= 1
                if depth == 0:
                    end = tok.end()
                    break
        blocks.append(text[start:end])
        pos = end
    return blocks


def check_grammar(spec: str) -> None:
    """Caps of a Lark or GBNF grammar: bytes, lines, rule definitions, nesting, and those of a JSON schema for each
    schema it embeds (``%json { ... }``: ``load_schema``). Raises ``StructuredSpecError``."""
    check_size(spec)
    if not spec.strip():
        raise StructuredSpecError("must not be empty")
    lines = spec.count("\n") + 1
    if lines > MAX_GRAMMAR_LINES:
        raise StructuredSpecError(f"has {lines} lines; at most {MAX_GRAMMAR_LINES} are allowed")
    rules = sum(1 for _ in _RULE.finditer(spec))
    if rules > MAX_GRAMMAR_RULES:
        raise StructuredSpecError(f"defines {rules} rules; at most {MAX_GRAMMAR_RULES} are allowed")
    depth = max_nesting(spec, _OPAQUE)
    if depth > MAX_NESTING:
        raise StructuredSpecError(f"nests groups {depth} levels deep; at most {MAX_NESTING} are allowed")
    for block in json_blocks(spec):
        try:
            load_schema(block)
        except StructuredSpecError as exc:
            raise StructuredSpecError(f"embeds a JSON schema (%json) that {exc}") from None


def check_regex(spec: str) -> None:
    """Caps of a regular expression (Rust ``regex`` syntax): bytes, group nesting. Raises ``StructuredSpecError``."""
    check_size(spec)
    if not spec:
        raise StructuredSpecError("must not be empty")
    depth = max_nesting(spec, _REGEX_OPAQUE)
    if depth > MAX_NESTING:
        raise StructuredSpecError(f"nests groups {depth} levels deep; at most {MAX_NESTING} are allowed")


def check_value_size(value: Any) -> None:
    """Refuse a parsed JSON value (a schema object from a request body) whose serialisation would be over
    ``STRUCTURED_MAX_SPEC_BYTES``, without serialising it: a walk that adds up a lower bound of its JSON text
    (string lengths and quotes, one character per number, structure) and stops as soon as it passes the cap, so a
    megabytes-large schema costs about the cap's worth of work, not its own size. Raises ``StructuredSpecError``."""
    size = 0
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            size += len(item) + 2
        elif isinstance(item, dict):  # '{"k": v, "k2": v2}': braces and separators, 4 a key, 2 when empty
            size += 4 * len(item) if item else 2
            for k, v in item.items():  # stops inside a wide object too: its width is not a cost
                size += len(k) + 2
                if size > MAX_SPEC_BYTES:
                    break
                stack.append(v)
        elif isinstance(item, list):  # '[a, b]': 2 an item, 2 when empty
            size += 2 * len(item) if item else 2
            if size <= MAX_SPEC_BYTES:
                stack.extend(item)
        else:
            size += 1
        if size > MAX_SPEC_BYTES:
            raise StructuredSpecError(f"is more than {MAX_SPEC_BYTES} bytes long; at most {MAX_SPEC_BYTES} are "
                                      "allowed")


def load_choices(spec: str) -> list[str]:
    """The choice list ``spec`` (a JSON list of non-empty strings, at most ``STRUCTURED_MAX_CHOICES``). Raises
    ``StructuredSpecError``."""
    check_size(spec)
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
    return choices


def load_schema(spec: str) -> dict[str, Any]:
    """The JSON schema ``spec`` parsed, within the caps (bytes, depth, ``$ref`` s, ``$defs`` entries) and free of
    a ``$ref`` cycle with nothing between (``ref_cycle``). Raises ``StructuredSpecError``."""
    check_size(spec)
    try:
        schema = json.loads(spec)
    except ValueError as exc:
        raise StructuredSpecError(f"is not valid JSON: {exc}") from None
    except RecursionError:
        raise StructuredSpecError(f"nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    if not isinstance(schema, dict):
        raise StructuredSpecError("must be a JSON object (a JSON schema)")
    depth, refs, defs = _shape(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise StructuredSpecError(f"nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed")
    if refs > MAX_SCHEMA_REFS:
        raise StructuredSpecError(f"holds {refs} $ref keywords; at most {MAX_SCHEMA_REFS} are allowed")
    if defs > MAX_SCHEMA_DEFS:
        raise StructuredSpecError(f"defines {defs} subschemas under $defs/definitions; at most {MAX_SCHEMA_DEFS} "
                                  "are allowed")
    cycle = ref_cycle(schema)
    if cycle is not None:
        raise StructuredSpecError(f"refers to itself with nothing in between ({cycle}): no JSON value matches it")
    return schema


def _shape(value: Any) -> tuple[int, int, int]:
    """``(depth, $ref count, $defs/definitions entries)`` of a JSON value, in one iterative pass."""
    deepest = refs = defs = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, depth + 1)
            refs += "$ref" in item
            for key in ("$defs", "definitions"):
                if isinstance(item.get(key), dict):
                    defs += len(item[key])
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, depth + 1)
            stack.extend((v, depth + 1) for v in item)
    return deepest, refs, defs


# keywords that describe a schema without constraining its values: a node with only these beside ``$ref`` is the
# schema it refers to
_ANNOTATIONS = frozenset({"$ref", "$defs", "definitions", "$schema", "$id", "$anchor", "$comment", "title",
                          "description", "default", "examples", "deprecated", "readOnly", "writeOnly"})


def _pointer(root: Any, ref: str) -> Any:
    """The node of ``root`` a local ``$ref`` (``#`` or ``#/a/b``, RFC 6901 escapes) names; None when it names none
    (or is not local: remote references are refused by the library). Linear in ``len(ref)``."""
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


def _is_alias(node: Any) -> bool:
    """A schema node that is only a ``$ref`` (plus annotations): it matches what its target matches."""
    return isinstance(node, dict) and isinstance(node.get("$ref"), str) and node.keys() <= _ANNOTATIONS


def ref_cycle(schema: Any) -> str | None:
    """A chain of local ``$ref`` s in ``schema`` that comes back to where it started with no constraint on the way
    (e.g. ``{"$ref": "#"}``, or ``a → b → a`` under ``$defs``), as ``"#/$defs/a -> #/$defs/b -> #/$defs/a"``
    (the ref into the cycle, then each ref around it); None when there is none. Such a schema matches no JSON
    value, yet llguidance compiles it to a grammar whose only output is the empty string (a 200 with empty
    ``content``), so it is refused up front.

    Linear in the schema: every alias node (``_is_alias``) has one successor (the node its ``$ref`` names), so the
    aliases form a functional graph, walked once with three colours. (The walk it replaces restarted from every
    node and searched its chain as a list: cubic in a chain's length, 24 s for a 64 KiB chain.)"""
    aliases: list[dict[str, Any]] = []
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if _is_alias(node):
                aliases.append(node)
            stack.extend(node.values())
    state: dict[int, int] = {}  # id(alias) → 1 on the current walk, 2 done
    for start in aliases:
        path: list[dict[str, Any]] = []
        current: Any = start
        while _is_alias(current) and state.get(id(current)) is None:
            state[id(current)] = 1
            path.append(current)
            current = _pointer(schema, current["$ref"])
        if _is_alias(current) and state.get(id(current)) == 1:  # back on this walk: a cycle
            entry = next(i for i, p in enumerate(path) if p is current)
            refs = [path[-1]["$ref"], *(p["$ref"] for p in path[entry:])]
            return " -> ".join(refs)
        for p in path:
            state[id(p)] = 2
    return None
