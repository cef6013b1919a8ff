"""inference.protocol.render: the render and mm tasks' typed requests and answers round-trip through their wire
form, the wire form is the payload the workers always read (old-shape payloads still parse), and a worker's failure
carries the public error code of its class. The task bodies run for real (tokenizers from .cache/tokenizers)."""

from __future__ import annotations

import json

import pytest

from inference.workers import mm_tasks, tasks
from inference.protocol.errors import ErrorCode
from inference.protocol.render import (
    MM_QUEUE,
    RENDER_QUEUE,
    ChatRenderRequest,
    DetokenizeRenderRequest,
    ImageFeatures,
    ImagesRequest,
    ImageWorkItem,
    PayloadError,
    PreprocessedImages,
    RenderedText,
    RenderedTokens,
    RenderFailure,
    TokenizeRenderRequest,
    failure_code,
)
from tests.renderer.tokdirs import tok_dir

CHAT = ChatRenderRequest("/tok", [{"role": "user", "content": "héllo"}], add_generation_prompt=False,
                         continue_final_message=True, tools=[{"type": "function", "function": {"name": "f"}}],
                         documents=[{"text": "d"}], chat_template="{{ 1 }}", client_chat_template=True,
                         chat_template_kwargs={"enable_thinking": False}, add_special_tokens=True,
                         allow_control_tokens=True, max_model_len=256, return_prompt_text=False, cache_salt="s" * 64)
REQUESTS = [CHAT, ChatRenderRequest("/tok", []), TokenizeRenderRequest("/tok", "Hi", False, 99, "salt"),
            TokenizeRenderRequest("/tok", "Hi"), DetokenizeRenderRequest("/tok", [1, 2], True),
            ImagesRequest("p", "/m", [ImageWorkItem("messages[0].content[1]", url="https://x/a.png"),
                                      ImageWorkItem("messages[0].content[2]", key="k", blob="p:mm:blob:k")],
                          ["example.com"], "salt", 1024)]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: type(r).__name__)
def test_requests_round_trip_through_json(request_):
    """What the api sends is what the worker reads: ``from_wire(json(to_wire()))`` is the same request, and the
    wire form is plain JSON (the Celery message's argument)."""
    wire = json.loads(json.dumps(request_.to_wire()))
    assert type(request_).from_wire(wire) == request_
    assert request_.queue == (MM_QUEUE if isinstance(request_, ImagesRequest) else RENDER_QUEUE)


def test_the_chat_payload_keeps_its_keys():
    """The chat task's argument has the keys the render workers read before the typed requests (plus nothing
    else): a worker of the previous release reads a new api's message, and the reverse (a missing key defaults)."""
    assert set(CHAT.to_wire()) == {
        "tokenizer_dir", "messages", "add_generation_prompt", "continue_final_message", "tools", "documents",
        "chat_template", "client_chat_template", "chat_template_kwargs", "add_special_tokens", "allow_control_tokens",
        "max_model_len", "return_prompt_text", "cache_salt"}
    old = {"tokenizer_dir": "/tok", "messages": [], "reply_to": "x:render:reply:1", "reply_id": "r"}
    assert ChatRenderRequest.from_wire(old) == ChatRenderRequest("/tok", [])
    with pytest.raises(PayloadError) as err:
        TokenizeRenderRequest.from_wire({"tokenizer_dir": "/tok"})
    assert err.value.param == "prompt"


@pytest.mark.parametrize("result,request_", [
    (RenderedTokens([1, 2], "text", {"hits": 1, "misses": 2}), CHAT),
    (RenderedTokens([5]), TokenizeRenderRequest("/tok", "Hi")),
    (RenderedText("Hi"), DetokenizeRenderRequest("/tok", [1])),
    (PreprocessedImages([ImageFeatures("k", 12, True), ImageFeatures("j", 3)]), REQUESTS[-1]),
    (RenderFailure("TemplateLimitError", "too big", "chat_template", ErrorCode.TEMPLATE_LIMIT), CHAT),
])
def test_answers_round_trip(result, request_):
    assert request_.parse_reply(json.loads(json.dumps(result.to_wire()))) == result


def test_a_failure_without_a_code_gets_its_class_code():
    """A reply from a worker older than the ``code`` field is mapped by its error class, as the gateway did."""
    old = {"ok": False, "error": {"type": "ContextLengthError", "message": "long", "param": "prompt"}}
    assert TokenizeRenderRequest("/t", "x").parse_reply(old) == RenderFailure(
        "ContextLengthError", "long", "prompt", "context_length_exceeded")
    assert failure_code("InternalError") == ErrorCode.RENDER_INTERNAL_ERROR
    assert failure_code("TemplateRenderError") == ErrorCode.INVALID_PROMPT


def test_worker_bodies_answer_typed_values():
    """The task bodies, run for real, answer on the wire what the typed requests read back: the ids, the text, and
    failures with their codes (a malformed argument, a bad token id, an over-long prompt)."""
    d = tok_dir("qwen3")
    hello = TokenizeRenderRequest(d, "Hello")
    assert hello.parse_reply(tasks.run_tokenize_prompt(hello.to_wire())) == RenderedTokens([9707])
    back = DetokenizeRenderRequest(d, [9707])
    assert back.parse_reply(tasks.run_detokenize(back.to_wire())) == RenderedText("Hello")
    chat = ChatRenderRequest(d, [{"role": "user", "content": "Hi"}], return_prompt_text=False)
    answer = chat.parse_reply(tasks.run_render_chat(chat.to_wire()))
    assert isinstance(answer, RenderedTokens) and answer.prompt_text is None and answer.prompt_token_ids
    assert tasks.run_tokenize_prompt({"prompt": "x"})["error"] == {
        "type": "RenderError", "message": "payload is missing 'tokenizer_dir'", "param": "tokenizer_dir",
        "code": "invalid_prompt"}
    too_long = TokenizeRenderRequest(d, "Hi " * 1000, max_model_len=1)
    failure = too_long.parse_reply(tasks.run_tokenize_prompt(too_long.to_wire()))
    assert isinstance(failure, RenderFailure) and (failure.type, failure.param, failure.code) == (
        "ContextLengthError", "prompt", "context_length_exceeded")


def test_mm_task_failures_carry_their_codes():
    """The ``mm`` task's failures: a malformed argument is the worker's defect (``mm_internal_error``); its
    time-limit error has the public code ``image_timeout`` (an ``ErrorCode`` now)."""
    reply = mm_tasks.run_mm_preprocess({"model_dir": "/m"})
    assert reply["ok"] is False and reply["error"]["code"] == ErrorCode.MM_INTERNAL_ERROR
    assert failure_code("ImageTimeoutError") == ErrorCode.IMAGE_TIMEOUT == "image_timeout"
