"""Images in chat, end to end: data: URLs and loopback http URLs through the ``mm`` queue, the shared
feature cache and the demo Qwen2-VL engine. Only loopback is ever contacted."""

from __future__ import annotations

import concurrent.futures
import time
import uuid

import pytest

from harness.assets import VL_MODEL
from tests.multimodal.imgs import bomb_png
from harness.images import data_url, image_bytes
from tests.multimodal.servers import send_bytes, serve, stall
from tests.support.live import post_json


post = post_json


def image_chat_body(url: str, text: str = "What is in the picture?", model: str = VL_MODEL, **kw) -> dict:
    return {"model": model, "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}],
        **kw}


def chat(live, url: str, text: str = "What is in the picture?", model: str = VL_MODEL, **kw):
    return post(live, "/v1/chat/completions", image_chat_body(url, text, model, **kw))


def processor_calls(live) -> int:
    return int(live.redis.get(f"{live.prefix}:mm:processor_calls") or 0)


def text_tokens(live) -> int:
    status, body = post(live, "/v1/chat/completions", {"model": VL_MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is in the picture?"}]}]})
    assert status == 200, body
    return body["usage"]["prompt_tokens"]


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                      ("GIF", "image/gif")])
def test_image_chat_formats(live_vl, fmt, mime):
    status, body = chat(live_vl, data_url(image_bytes(fmt, seed=hash(fmt) % 1000), mime), return_token_ids=True)
    assert status == 200, body
    assert len(body["choices"][0]["token_ids"]) >= 1
    ids = body["prompt_token_ids"]
    n_image = ids.count(151655)
    # 90x60 -> resized to a multiple of 28 within [4, 64]*28^2 pixels: 84x56 -> grid 6x4 patches -> 6 tokens
    assert n_image == 6
    assert body["usage"]["prompt_tokens"] == len(ids) == text_tokens(live_vl) + 2 + n_image  # + start/end


def mm_tasks(live) -> int:
    return int(live.redis.get(f"{live.prefix}:mm:tasks_total") or 0)


def test_same_image_processed_once_and_second_faster(live_vl):
    url = data_url(image_bytes("PNG", size=(600, 400), seed=7))
    before, tasks_before = processor_calls(live_vl), mm_tasks(live_vl)
    t0 = time.perf_counter()
    s1, b1 = chat(live_vl, url)
    t1 = time.perf_counter()
    s2, b2 = chat(live_vl, url)
    t2 = time.perf_counter()
    assert s1 == s2 == 200
    assert processor_calls(live_vl) - before == 1
    # the repeat is found in the shared cache by the api process: it never reaches an mm worker
    assert mm_tasks(live_vl) - tasks_before == 1
    assert b1["choices"][0]["message"]["content"] == b2["choices"][0]["message"]["content"]
    assert b1["usage"]["prompt_tokens"] == b2["usage"]["prompt_tokens"]
    # the engine's prefix cache (keyed by the ids and the image's content key) serves all but the last position
    def cached(body) -> int:
        return body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)

    assert cached(b1) < b1["usage"]["prompt_tokens"] // 2  # at most the text before the image (earlier tests)
    assert b2["usage"]["prompt_tokens_details"]["cached_tokens"] == b2["usage"]["prompt_tokens"] - 1
    # another image at the same place in the same text: only the blocks before the image are reused
    s3, b3 = chat(live_vl, data_url(image_bytes("PNG", size=(600, 400), seed=8)))
    assert s3 == 200
    assert cached(b3) < b3["usage"]["prompt_tokens"] // 2
    print(f"first {t1 - t0:.3f}s second {t2 - t1:.3f}s")


def test_http_url_allowlisted_loopback_fetched_once(live_vl):
    data = image_bytes("PNG", seed=11)
    hits = {"n": 0}
    inner = send_bytes(data)

    def counting(h):
        hits["n"] += 1
        inner(h)

    srv, port = serve("127.0.0.1", {"/img.png": counting})
    try:
        url = f"http://127.0.0.1:{port}/img.png"
        s1, b1 = chat(live_vl, url)
        s2, b2 = chat(live_vl, url)
        assert s1 == s2 == 200, (b1, b2)
        assert hits["n"] == 1
    finally:
        srv.shutdown()


def test_non_allowlisted_loopback_refused(live_vl):
    srv, port = serve("::1", {"/img.png": send_bytes(image_bytes())})
    try:
        status, body = chat(live_vl, f"http://[::1]:{port}/img.png")
        assert status == 400, body
        assert body["error"]["param"] == "messages[0].content[1]"
        assert "loopback" in body["error"]["message"]
    finally:
        srv.shutdown()


@pytest.mark.parametrize("url,code", [
    (data_url(b"not an image at all"), "unsupported_image"),
    (data_url(image_bytes("PNG")[:200]), "invalid_image"),
    (data_url(bomb_png()), "image_too_large"),
    (data_url(image_bytes("BMP"), "image/bmp"), "unsupported_image"),
    ("data:image/png;base64,@@@notbase64", "invalid_image"),
    ("data:text/plain;base64,aGVsbG8=", "invalid_image"),
    ("file:///etc/passwd", "image_url_blocked"),
])
def test_bad_images_are_400_naming_the_part(live_vl, url, code):
    status, body = chat(live_vl, url)
    assert status == 400, body
    assert body["error"]["param"] == "messages[0].content[1]", body
    assert body["error"]["code"] == code, body


def test_text_model_refuses_images(live_vl):
    status, body = chat(live_vl, data_url(image_bytes()), model="tiny-qwen3")
    assert status == 400 and body["error"]["param"] == "messages"


def test_text_requests_answered_while_mm_queue_busy(live_vl):
    hits: list = []
    srv, port = serve("127.0.0.1", {"/slow.png": stall(5, hits=hits)})
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            # four fetches the mm worker (concurrency 1) can only take one at a time, each cut at 3 s; from four
            # tenants, as one tenant may have only MM_TENANT_MAX_CONCURRENT (2) image requests in flight
            run = uuid.uuid4().hex[:6]
            keys = [live_vl.new_key(tenant=f"mmq-{i}-{run}") for i in range(4)]
            busy = [pool.submit(post_json, live_vl, "/v1/chat/completions", image_chat_body(
                f"http://127.0.0.1:{port}/slow.png?{i}"), key=keys[i]) for i in range(4)]
            deadline = time.monotonic() + 60
            while not hits and time.monotonic() < deadline:  # the mm worker is now stuck on a stalling fetch
                time.sleep(0.02)
            assert hits, "the mm worker never fetched"
            status, body = post(live_vl, "/v1/chat/completions", {"model": VL_MODEL, "max_tokens": 2,
                                "messages": [{"role": "user", "content": "hello"}]})
            assert status == 200, body
            assert not busy[-1].done()  # the text request did not wait for the image queue to drain
            results = [f.result(timeout=120) for f in busy]
        for status, body in results:
            assert status == 400 and body["error"]["code"] == "image_fetch_timeout", body
    finally:
        srv.shutdown()


def test_tokenize_chat_with_image_returns_expanded_ids(live_vl):
    """/tokenize of a chat body with an image gives the ids the engine gets (placeholders expanded)."""
    url = data_url(image_bytes("PNG", seed=21))
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    status, tok = post(live_vl, "/tokenize", {"model": VL_MODEL, "messages": messages})
    assert status == 200, tok
    assert tok["tokens"].count(151655) == 6 and tok["count"] == len(tok["tokens"])
    status, body = post(live_vl, "/v1/chat/completions", {"model": VL_MODEL, "max_tokens": 1, "messages": messages,
                                                          "return_token_ids": True})
    assert status == 200, body
    assert body["prompt_token_ids"] == tok["tokens"]
    status, err = post(live_vl, "/tokenize", {"model": VL_MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    assert status == 400 and err["error"]["param"] == "messages[0].content[0]", err
