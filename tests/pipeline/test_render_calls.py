"""The gateway's typed render calls (gateway/pipeline/rendering.py, failures.py): a ``RenderRequest`` in, its result
or the HTTP error its worker's typed failure maps to, from one table. Rendering runs for real on the inline route
(the task bodies on this process's threads, the real tokenizers); the failure table is checked code by code."""

from __future__ import annotations

import pytest

from gateway.errors import ApiError
from gateway.pipeline import failures, rendering
from inference.media.image import ImageError
from inference.protocol.render import (
    MM_QUEUE,
    ChatRenderRequest,
    DetokenizeRenderRequest,
    RenderedText,
    RenderedTokens,
    RenderFailure,
    TokenizeRenderRequest,
)
from inference.api.render_client import RenderUnavailableError
from inference.renderer.chat_template import render_chat
from tests.renderer.tokdirs import tok_dir
from tests.support.redis import TEST_REDIS_URL, fresh_prefix

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def inline(settings):
    with fresh_prefix("rendercall") as prefix:
        settings.REDIS_URL, settings.LINK_PREFIX, settings.RENDER_ROUTE = TEST_REDIS_URL, prefix, "inline"
        yield


async def test_inline_calls_answer_typed_results(inline):
    d = tok_dir("qwen3")
    rendered = await rendering.call_render(ChatRenderRequest(d, HI, return_prompt_text=False))
    assert rendered == RenderedTokens(render_chat(d, HI).prompt_token_ids, None, rendered.segment_cache)
    assert (await rendering.call_render(TokenizeRenderRequest(d, "Hello"))).prompt_token_ids == [9707]
    assert await rendering.call_render(DetokenizeRenderRequest(d, [9707])) == RenderedText("Hello")


async def test_a_worker_failure_is_its_http_error(inline):
    """A renderer error comes back as a typed failure with its code and becomes the client's 400 with the field."""
    with pytest.raises(ApiError) as err:
        await rendering.call_render(ChatRenderRequest(tok_dir("qwen3"), [{"role": "user", "content": "x" * 5000}],
                                                      max_model_len=1))
    assert (err.value.status, err.value.param, err.value.code) == (400, "messages", "context_length_exceeded")
    with pytest.raises(ApiError) as err:
        await rendering.call_render(DetokenizeRenderRequest(tok_dir("qwen3"), [10**9]))
    assert (err.value.status, err.value.param, err.value.code) == (400, "tokens", "invalid_prompt")


async def test_a_client_template_never_runs_inline(inline):
    request = ChatRenderRequest(tok_dir("qwen3"), HI, chat_template="{{ 1 }}", client_chat_template=True)
    assert not rendering.runs_inline(request)
    with pytest.raises(ValueError):
        await rendering.call_inline(request)


@pytest.mark.parametrize("failure,expected", [
    (RenderFailure.of("InternalError", "KeyError: x"), (500, "render_internal_error", None, "server_error")),
    (RenderFailure("InternalError", "boom", None, "mm_internal_error"), (500, "mm_internal_error", None, "server_error")),
    (RenderFailure.of("RenderOverloadedError", "slow"), (503, "render_unavailable", None, "server_error")),
    (RenderFailure.of("TemplateTimeoutError", "t", "messages"), (400, "template_timeout", "messages",
                                                                 "invalid_request_error")),
    (RenderFailure.of("NoChatTemplateError", "none", "messages"), (400, "no_chat_template", "messages",
                                                                   "invalid_request_error")),
    (RenderFailure.of("TemplateRenderError", "nope", "messages"), (400, "invalid_prompt", "messages",
                                                                   "invalid_request_error")),
    (RenderFailure.of("ImageTimeoutError", "late", "messages"), (400, "image_timeout", "messages",
                                                                 "invalid_request_error")),
    (RenderFailure("ImageError", "bad", "messages[0].content[1]", "invalid_image"),
     (400, "invalid_image", "messages[0].content[1]", "invalid_request_error")),
    (RenderUnavailableError("No render worker answered within 20 s"), (503, "render_unavailable", None,
                                                                       "server_error")),
    (RenderUnavailableError("No mm worker answered within 60 s", MM_QUEUE), (503, "mm_unavailable", None,
                                                                             "server_error")),
    (ImageError("too many pixels", "messages[0].content[0]"), (400, "invalid_image", "messages[0].content[0]",
                                                               "invalid_request_error")),
])
def test_the_one_table_maps_render_and_image_errors(failure, expected):
    err = failures.api_error_from(failure)
    assert (err.status, err.code, err.param, err.type) == expected
    if err.status == 500:  # a worker's defect: its text stays in the worker's log
        assert err.message in ("The renderer failed unexpectedly", "Image preprocessing failed unexpectedly")
    if err.status == 503:
        assert ("retry-after", "2") in err.headers


def test_pooling_errors_in_the_table():
    """A pooling replica's refusal of an input is the client's 400; any other engine failure a 503."""
    refused = failures.pooling_error("token id 99999 out of range [0, 30522)")
    assert (refused.status, refused.param) == (400, "input")
    assert failures.pooling_error("input has 600 tokens; max_model_len is 512").status == 400
    failed = failures.pooling_error(None)
    assert (failed.status, failed.code) == (503, "engine_error")
