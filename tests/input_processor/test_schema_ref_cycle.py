"""``inference.shared.structured.ref_cycle``: a JSON schema whose local ``$ref`` s come back to themselves with no
constraint on the way matches no value (llguidance compiled it to a grammar of the empty string: a 200 with empty
content), so ``check`` refuses it; a recursive schema whose recursion passes through a constraint is fine."""

from __future__ import annotations

import json

import pytest

from inference.shared.structured import StructuredSpecError, check, ref_cycle

CYCLES = [
    ({"$ref": "#"}, "# -> #"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "#/$defs/a -> #/$defs/b -> #/$defs/a"),
    ({"type": "object", "properties": {"x": {"$ref": "#/definitions/s"}},
      "definitions": {"s": {"$ref": "#/definitions/s", "title": "only an annotation"}}},
     "#/definitions/s -> #/definitions/s"),
    ({"$defs": {"a~b": {"$ref": "#/$defs/a~0b"}}, "$ref": "#/$defs/a~0b"}, "#/$defs/a~0b -> #/$defs/a~0b"),
]
FINE = [
    {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}}, "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"type": "string"}}},
    {"type": "array", "items": {"$ref": "#"}},
]


@pytest.mark.parametrize(("schema", "chain"), CYCLES)
def test_a_ref_cycle_with_nothing_between_is_refused(schema, chain):
    assert ref_cycle(schema) == chain
    with pytest.raises(StructuredSpecError, match="refers to itself"):
        check("json", json.dumps(schema))


@pytest.mark.parametrize("schema", FINE)
def test_recursion_through_a_constraint_is_not_a_cycle(schema):
    assert ref_cycle(schema) is None
    check("json", json.dumps(schema))
