"""Issue 14, request caps: no body of at most the 16 MB body cap makes the api allocate more than 10x its size
while it parses, validates and processes it into engine requests, and every over-cap value is a 400 naming
its field.

Each amplifier found (what a short body could multiply) gets:

* a tracemalloc measurement of the api-side work (``parse_json_body`` + schema validation + input
  processing up to the wire entries ``EngineLink.add_requests`` sends) on the body that used to amplify:
  peak <= 10x the body + ``ALLOWANCE`` (a bounded amount: the per-object overhead of the capped counts,
  e.g. 2,048 ``ChatMessage`` objects, and the parser's own buffers);
* the worst body under the caps, measured the same way (accepted, and within the bound);
* the over-cap body's 400 and ``param``.

The live tests at the end send the cheap over-cap bodies through a real platform (api + engine).
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from inference.api.input_processor import GenerationDefaults, process_inputs
from inference.protocol import engine as engine_proto
from inference.protocol import openai as oa
from inference.protocol.openai import RequestValidationError, parse_json_body, validate_request

REPO = Path(__file__).resolve().parents[2]
ALLOWANCE = 8 * 1024 * 1024
VOCAB = 151_669  # qwen3's tokenizer
MAX_MODEL_LEN = 32_768
# the caps as documented (inference/protocol/openai.py, README)
MAX_STOP_STRING_LEN, MAX_STOP_TOKEN_IDS, MAX_LOGIT_BIAS, MAX_MODEL_NAME_LEN = 1024, 256, 300, 128
MAX_MESSAGES, MAX_TOOLS, MAX_DOCUMENTS, MAX_CONTENT_PARTS, MAX_REQUEST_ID_LEN = 2048, 128, 256, 4096, 128


@pytest.fixture(autouse=True, scope="module")
def _imported():
    """Import the gateway modules before any measurement (their import is not the request's cost)."""
    import gateway.endpoints.embeddings
    import gateway.pipeline.preamble
    import gateway.model_cache  # noqa: F401


def peak_of(fn) -> tuple[int, object]:
    """(peak bytes traced while ``fn()`` runs, its result or the ``RequestValidationError`` it raised)."""
    tracemalloc.start()
    try:
        try:
            result = fn()
        except RequestValidationError as exc:
            result = exc
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


def wire_entries(requests) -> list:
    """What ``EngineLink.add_requests`` writes to the request stream for ``requests``."""
    pack = getattr(engine_proto, "pack_requests", None)
    if pack is None:  # before issue 14: one full entry per child
        return [{"r": r.to_wire()} for r in requests]
    return pack(requests)


def generation_pipeline(body: bytes, schema=oa.CompletionRequest, prompt_ids=None):
    """parse + validate + ``process_inputs`` + wire entries, as the chat/completions routes run them (the chat
    template renders in a render worker: ``prompt_ids`` stands in for its result)."""
    req = validate_request(schema, parse_json_body(body))
    ids = prompt_ids if prompt_ids is not None else (req.prompt if schema is oa.CompletionRequest else [1, 2, 3])
    processed = process_inputs(req, external_id="cmpl-x", prompt_token_ids=list(ids), prompt_param="prompt",
                               max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB,
                               defaults=GenerationDefaults(eos_token_ids=(151645, 151643)), client_id="c",
                               logprobs=None)
    return wire_entries(processed.requests)


def embeddings_pipeline(body: bytes):
    """parse + validate + normalize + request id + one pooling request per input, as ``/v1/embeddings`` runs
    them (token ids stand in for the tokenizer's output)."""
    from gateway.endpoints import embeddings as emb
    from gateway.pipeline.preamble import client_request_id

    req = validate_request(emb.EmbeddingRequest, parse_json_body(body))
    inputs = emb.normalize_input(req.input)
    external_id = "embd-" + client_request_id(None, req.request_id)
    token_ids = [[101, 102] for _ in inputs]
    if hasattr(emb, "pooling_requests"):
        reqs = emb.pooling_requests(external_id, token_ids, "c", 0.0)
    else:  # before issue 14: the same construction, inline in run_pooling
        reqs = [engine_proto.EngineCoreRequest(
            request_id=f"{external_id}-{i}-abcd1234", external_req_id=external_id, prompt_token_ids=ids,
            sampling_params=engine_proto.SamplingParams(max_tokens=1), client_id="c", arrival_time=0.0,
            pooling=True) for i, ids in enumerate(token_ids)]
    return wire_entries(reqs)


def assert_bounded(peak: int, body: bytes) -> None:
    assert peak <= 10 * len(body) + ALLOWANCE, \
        f"peak {peak / 1e6:.1f} MB for a {len(body) / 1e6:.2f} MB body ({peak / len(body):.0f}x)"


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


MSGS = [{"role": "user", "content": "hi"}]

# ----------------------------------------------------------------------------- bodies that used to amplify

AMPLIFIERS = {
    # request_id copied into each of 2,048 per-input engine request ids
    "embeddings request_id x inputs": (
        embeddings_pipeline, {"model": "m", "input": ["a"] * 2048, "request_id": "r" * 32_768}, "request_id"),
    # stop_token_ids copied into each of n=128 children on the wire
    "stop_token_ids x n": (
        generation_pipeline, {"model": "m", "prompt": [1, 2, 3], "n": 128, "max_tokens": 1,
                              "stop_token_ids": [i % 150_000 for i in range(200_000)]}, "stop_token_ids"),
    # logit_bias copied into each of n=128 children on the wire
    "logit_bias x n": (
        generation_pipeline, {"model": "m", "prompt": [1, 2, 3], "n": 128, "max_tokens": 1,
                              "logit_bias": {str(i): 1 for i in range(100_000)}}, "logit_bias"),
    # one ChatMessage object (~700 bytes) per 15-byte message
    "messages": (
        lambda b: generation_pipeline(b, oa.ChatCompletionRequest),
        {"model": "m", "messages": [{"role": "user"}] * 45_000}, "messages"),
    # two pydantic objects per tool
    "tools": (
        lambda b: generation_pipeline(b, oa.ChatCompletionRequest),
        {"model": "m", "messages": MSGS, "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                                   for i in range(20_000)]}, "tools"),
    # the generic parser: 56-250 bytes per 3-byte "{}"
    "JSON containers": (
        lambda b: generation_pipeline(b, oa.ChatCompletionRequest),
        {"model": "m", "messages": MSGS, "ignored": [{}] * 1_200_000}, None),
}


@pytest.mark.parametrize("name", list(AMPLIFIERS))
def test_amplifying_body_is_bounded_and_refused(name):
    pipeline, obj, param = AMPLIFIERS[name]
    body = dumps(obj)
    peak, result = peak_of(lambda: pipeline(body))
    assert_bounded(peak, body)
    assert isinstance(result, RequestValidationError), "the over-cap body was accepted"
    assert result.param == param


def test_model_name_is_not_amplified_nor_kept():
    """A long or impossible ``model`` is a 400 at validation; such a name is never looked up nor cached."""
    import asyncio

    from gateway import model_cache

    for bad in ("m" * 129, "a b", "../x", "m\n", "-m", "m" * 1_000_000):
        peak, result = peak_of(lambda bad=bad: validate_request(oa.ChatCompletionRequest,
                                                       parse_json_body(dumps({"model": bad, "messages": MSGS}))))
        assert isinstance(result, RequestValidationError) and result.param == "model", bad
        before = len(model_cache._cache)
        assert asyncio.run(model_cache.get_model(bad)) is None
        assert len(model_cache._cache) == before
    from registry.models import SERVED_MODEL_NAME_RE

    assert oa.SERVED_MODEL_NAME_RE == SERVED_MODEL_NAME_RE


# ----------------------------------------------------------------------------- the worst bodies under the caps

def _worst_generation_bodies():
    long_text = "x" * 4000
    yield "completion: n=128, 256 stop ids, 300 logit_bias, 4 stop strings at the cap, 30k-token prompt", \
        generation_pipeline, {
            "model": "m" * 128, "prompt": list(range(1000, 31_000)), "n": 128, "max_tokens": 16,
            "stop_token_ids": list(range(256)), "logit_bias": {str(i): 5 for i in range(300)},
            "stop": ["s" * MAX_STOP_STRING_LEN] * 4, "request_id": "r" * 128}
    yield "chat: 2,048 minimal messages", lambda b: generation_pipeline(b, oa.ChatCompletionRequest), {
        "model": "m", "messages": [{"role": "user", "content": ""}] * MAX_MESSAGES}
    yield "chat: 4,096 content parts, 128 tools, 256 documents", \
        lambda b: generation_pipeline(b, oa.ChatCompletionRequest), {
            "model": "m", "n": 128,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 2048}] * 2,
            "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
                      for i in range(MAX_TOOLS)],
            "documents": [{"title": "t", "text": "d"}] * MAX_DOCUMENTS}
    yield "chat: 2,048 messages of 7 KB (15 MB)", lambda b: generation_pipeline(b, oa.ChatCompletionRequest), {
        "model": "m", "messages": [{"role": "user", "content": long_text * 2}] * MAX_MESSAGES}
    yield "embeddings: 2,048 inputs of 7 KB, 128-char request_id", embeddings_pipeline, {
        "model": "m", "input": [long_text * 2] * 2048, "request_id": "r" * 128}


@pytest.mark.parametrize("case", list(_worst_generation_bodies()), ids=lambda c: c[0].split(":")[0] + c[0][-12:])
def test_worst_body_under_caps_is_accepted_and_bounded(case):
    """Passes before the fix too (no amplifier in these bodies); guards that the caps leave room for them."""
    _name, pipeline, obj = case
    body = dumps(obj)
    assert len(body) <= 16 * 1024 * 1024
    peak, result = peak_of(lambda: pipeline(body))
    assert not isinstance(result, RequestValidationError), result
    assert_bounded(peak, body)


def test_n_children_share_one_wire_entry():
    """The n children of one request cross the link once: one entry whose size does not grow with n."""
    body = lambda n: dumps({"model": "m", "prompt": list(range(1000, 5000)), "n": n, "max_tokens": 4,
                            "stop_token_ids": list(range(256)), "seed": 7})
    one, many = generation_pipeline(body(1)), generation_pipeline(body(128))
    assert len(many) == 1
    size = lambda entries: sum(len(v) for e in entries for v in e.values())
    assert size(many) < 2 * size(one)
    reqs = engine_proto.unpack_entry({k.encode(): v for k, v in many[0].items()})
    assert len(reqs) == 128 and len({r.request_id for r in reqs}) == 128
    assert [r.sampling_params.seed for r in reqs] == [7 + i for i in range(128)]
    assert reqs[0].prompt_token_ids == list(range(1000, 5000))
    assert reqs[5].sampling_params.stop_token_ids == list(range(256))


def test_stop_and_eos_ids_are_deduplicated_and_capped():
    req = validate_request(oa.ChatCompletionRequest, {"messages": MSGS, "stop_token_ids": [5, 5, 3, 5] * 100})
    assert req.stop_token_ids == [5, 3]
    gen = validate_request(oa.GenerateRequest, {"token_ids": [1], "sampling_params": {
        "eos_token_ids": [2, 2, 9], "stop_token_ids": list(range(256)) * 2}})
    assert gen.sampling_params.eos_token_ids == [2, 9] and len(gen.sampling_params.stop_token_ids) == 256


# ----------------------------------------------------------------------------- each cap: 400 naming the field

OVER_CAP = {
    "stop": ({"stop": ["s" * (MAX_STOP_STRING_LEN + 1)]}, "stop"),
    "stop_token_ids": ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    "logit_bias": ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    "model long": ({"model": "m" * (MAX_MODEL_NAME_LEN + 1)}, "model"),
    "model charset": ({"model": "tiny qwen3"}, "model"),
    "messages": ({"messages": MSGS * (MAX_MESSAGES + 1)}, "messages"),
    "tools": ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]},
              "tools"),
    "documents": ({"documents": [{"text": "d"}] * (MAX_DOCUMENTS + 1)}, "documents"),
    "content parts": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]
                                     * (MAX_CONTENT_PARTS + 1)}]}, "messages"),
    "request_id control": ({"request_id": "abc\r\nX-Evil: 1"}, "request_id"),
    "request_id long": ({"request_id": "r" * (MAX_REQUEST_ID_LEN + 1)}, "request_id"),
}


@pytest.mark.parametrize("name", list(OVER_CAP))
def test_over_cap_chat_field_is_400_naming_it(name):
    extra, param = OVER_CAP[name]
    with pytest.raises(RequestValidationError) as exc:
        validate_request(oa.ChatCompletionRequest, {"model": "tiny-qwen3", "messages": MSGS, **extra})
    assert exc.value.param == param


def test_over_cap_generate_and_embeddings_fields():
    from gateway.endpoints.embeddings import EmbeddingRequest

    for body, param in [
        ({"token_ids": [1], "request_id": "a\nb"}, "request_id"),
        ({"token_ids": [1], "sampling_params": {"eos_token_ids": list(range(300))}}, "sampling_params.eos_token_ids"),
        ({"token_ids": [1], "sampling_params": {"stop": ["s" * 1025]}}, "sampling_params.stop"),
        ({"token_ids": [1], "sampling_params": {"logit_bias": {str(i): 1 for i in range(301)}}},
         "sampling_params.logit_bias"),
    ]:
        with pytest.raises(RequestValidationError) as exc:
            validate_request(oa.GenerateRequest, body)
        assert exc.value.param == param, body
    for body, param in [({"input": "a", "request_id": "r" * 129}, "request_id"),
                        ({"input": "a", "request_id": "a\tb"}, "request_id"),
                        ({"input": "a", "model": "x" * 129}, "model")]:
        with pytest.raises(RequestValidationError) as exc:
            validate_request(EmbeddingRequest, body)
        assert exc.value.param == param, body


def test_client_request_id_caps_header_and_body():
    from gateway.errors import ApiError
    from gateway.pipeline.preamble import client_request_id

    assert client_request_id(b"abc-1", None) == "abc-1"
    for header, body, param in [(b"a\tb", None, "X-Request-Id"), (b"a\x7fb", None, "X-Request-Id"),
                                (b"x" * 129, None, "X-Request-Id"), (None, "y" * 129, "request_id")]:
        with pytest.raises(ApiError) as exc:
            client_request_id(header, body)
        assert exc.value.param == param


def test_json_containers_are_counted_outside_strings():
    """Brackets inside strings (escaped quotes and backslashes included) do not count; 50,000 real ones pass."""
    tricky = {"a": 'x{["{\\', "b": [{"c": "\\\\"}, '\\"[{'], "d": "[" * 10}
    ok = dumps({"model": "m", "messages": MSGS, "x": [tricky] * 16_000})  # 3 containers each + 4
    assert not isinstance(peak_of(lambda: parse_json_body(ok))[1], RequestValidationError)
    over = dumps({"model": "m", "messages": MSGS, "x": [tricky] * 17_000})
    result = peak_of(lambda: parse_json_body(over))[1]
    assert isinstance(result, RequestValidationError) and "50000" in result.message


def test_large_bodies_are_validated_off_the_event_loop():
    """Over ``OFF_LOOP_PARSE_BYTES`` (256 KB) the validation runs in a worker thread, as the parse does."""
    import asyncio
    import threading

    from gateway.pipeline.preamble import validated_body

    def where(data):
        return threading.current_thread() is threading.main_thread()

    small = dumps({"model": "m", "messages": MSGS})
    large = dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 300_000}]})
    assert asyncio.run(validated_body(small, where)) is True
    assert asyncio.run(validated_body(large, where)) is False
