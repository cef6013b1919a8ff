"""``parse_json_body``: the fast parser (pydantic-core) and the standard library agree on every body; errors
are the standard library's precise ones."""

from __future__ import annotations

import json

import pytest

from inference.protocol.openai import RequestValidationError, parse_json_body

GOOD = [
    b'{"a": 1, "b": [1.5, -0.0, 1e308, null, true], "c": {"d": "\\u00e9\\ud83d\\ude00 \xc3\xa9"}}',
    b'{"big": 123456789012345678901234567890, "neg": -98765432109876543210}',
    b'{"a": 1, "a": 2}',  # duplicate keys: the last wins, as in json.loads
    b'  {"deep": ' + b"[" * 99 + b"]" * 99 + b"}  ",  # 100 levels: the most accepted
    '{"utf16": "ok"}'.encode("utf-16"),  # json.loads detects UTF-16/32 bodies: so does the fallback
    b'{"inf": 1e999}',  # overflows to inf in both (the schemas refuse non-finite numbers)
]


@pytest.mark.parametrize("body", GOOD)
def test_same_result_as_the_standard_library(body):
    assert parse_json_body(body) == json.loads(body)


@pytest.mark.parametrize("body,message,param", [
    (b'{"a": NaN}', "NaN is not a valid JSON number", None),
    (b'{"a": "\\ud800"}', "lone UTF-16 surrogate", "a"),
    (b'{"x": [{"y": "ok \\udc00"}]}', "lone UTF-16 surrogate", "x[0].y"),
    (b'{"a": "\xed\xa0\x80"}', "lone UTF-16 surrogate", "a"),  # surrogate as raw bytes
    (b'{"a": "\xff"}', "Invalid JSON body", None),
    (b'{"a": 1} x', "Invalid JSON body", None),
    (b"[" * 100_000 + b"]" * 100_000, "more than 50000 JSON objects and arrays", None),  # refused before parsing
    (b"[" * 10_000 + b"]" * 10_000, "nested too deeply", None),
    # deeper than the bound but parseable: 500 levels once crashed a prefork worker while being pickled
    (b'{"tools": [{"type": "function", "function": {"name": "f", "parameters": ' + b'{"a": ' * 500 + b"1"
     + b"}" * 500 + b"}}]}", "nested too deeply", None),
    (b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}", "nested too deeply", None),
    (b"[1, 2]", "must be a JSON object", None),
])
def test_errors(body, message, param):
    with pytest.raises(RequestValidationError) as info:
        parse_json_body(body)
    assert message in info.value.message and info.value.param == param
