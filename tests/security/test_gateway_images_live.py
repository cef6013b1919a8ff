"""Issue 14, images: a request's URLs are fetched concurrently under one deadline, a tenant's image work is
bounded (429 past ``MM_TENANT_MAX_CONCURRENT``), and malformed image URLs are 400s naming the part, never 500s.
Live platform of tests/multimodal (its ``mm`` worker may fetch from 127.0.0.1 only, ``MM_FETCH_TIMEOUT_S=3``);
every server here listens on 127.0.0.1."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest

from harness.assets import VL_MODEL
from harness.images import image_bytes
from tests.multimodal.servers import serve


class SlowImage:
    """A route that waits ``delay_s`` and then sends a PNG (or, with ``stall``, stays silent); it records when
    each connection arrived and when its answer was done."""

    def __init__(self, delay_s: float, seed: int, stall: bool = False):
        self.delay_s, self.data, self.stall = delay_s, image_bytes(seed=seed), stall
        self.started: list[float] = []
        self.finished: list[float] = []
        self.lock = threading.Lock()

    def __call__(self, h) -> None:
        with self.lock:
            self.started.append(time.monotonic())
        time.sleep(self.delay_s)
        if not self.stall:
            h.send_response(200)
            h.send_header("Content-Type", "image/png")
            h.send_header("Content-Length", str(len(self.data)))
            h.end_headers()
            h.wfile.write(self.data)
            h.wfile.flush()
        with self.lock:
            self.finished.append(time.monotonic())


def chat_body(urls: list[str]) -> dict:
    content = [{"type": "text", "text": "Describe."}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": VL_MODEL, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": content}]}


def post(base_url: str, key: str, body: dict) -> httpx.Response:
    return httpx.post(base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=body,
                      timeout=120)


def test_images_of_a_request_are_fetched_concurrently(live_vl):
    routes = [SlowImage(1.0, seed=700 + i) for i in range(4)]
    servers = [serve("127.0.0.1", {f"/slow{i}.png": r}) for i, r in enumerate(routes)]
    try:
        urls = [f"http://127.0.0.1:{port}/slow{i}.png?{time.time_ns()}" for i, (_s, port) in enumerate(servers)]
        start = time.monotonic()
        r = post(live_vl.base_url, live_vl.api_key, chat_body(urls))
        print(f"4 images of 1 s each: answered in {time.monotonic() - start:.2f} s")
        assert r.status_code == 200, r.text
        # every server had its connection before any of them had answered: the four fetches overlapped
        assert all(len(x.started) == 1 and len(x.finished) == 1 for x in routes)
        assert max(x.started[0] for x in routes) < min(x.finished[0] for x in routes)
    finally:
        for srv, _port in servers:
            srv.shutdown()


def test_images_past_the_deadline_are_a_clean_400(live_vl):
    routes = [SlowImage(8.0, seed=800 + i, stall=True) for i in range(2)]
    servers = [serve("127.0.0.1", {"/stall.png": r}) for r in routes]
    try:
        urls = [f"http://127.0.0.1:{port}/stall.png?{time.time_ns()}" for _s, port in servers]
        r = post(live_vl.base_url, live_vl.api_key, chat_body(urls))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "image_fetch_timeout" and err["param"] == "messages[0].content[1]"
        # both fetches ran together under one deadline (the second did not wait for the first to time out)
        assert len(routes[0].started) == 1 and len(routes[1].started) == 1
        assert not routes[0].finished and not routes[1].finished
    finally:
        for srv, _port in servers:
            srv.shutdown()


@pytest.mark.parametrize("url", [
    "http://[::1", "http://[::1]:0/", "http://127.0.0.1:0/", "http://a:99999/", "http://%zz/",
    "http://[::ffff:999.1.1.1]/", "http://" + "a" * 300 + ".example/", "http://" + "a." * 200 + "example/",
    "data:image/png;base64,", "data:image/png;base64,%%%garbage", "data:image/png;base64,AAAA",
])
def test_malformed_image_urls_are_400_naming_the_part(live_vl, url):
    r = post(live_vl.base_url, live_vl.api_key, chat_body([url]))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1]" and err["type"] == "invalid_request_error"


def test_image_work_is_bounded_per_tenant(live_vl):
    _child, base = live_vl.start_api("api-mm-k1", env_extra={"MM_TENANT_MAX_CONCURRENT": "1"})
    tenant_a = f"sec-a-{time.time_ns()}"
    key_a1, key_a2 = live_vl.new_key(tenant=tenant_a), live_vl.new_key(tenant=tenant_a)
    key_b = live_vl.new_key()
    routes = {f"/a{i}.png": SlowImage(2.0, seed=900 + i) for i in range(4)}
    srv, port = serve("127.0.0.1", routes)
    try:
        def url(path: str) -> str:
            return f"http://127.0.0.1:{port}{path}?{time.time_ns()}"

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(post, base, key_a1, chat_body([url("/a0.png")]))
            deadline = time.monotonic() + 60
            while not routes["/a0.png"].started and time.monotonic() < deadline:
                time.sleep(0.05)  # the first request's image work has begun (its slot is held)
            second = post(base, key_a2, chat_body([url("/a1.png")]))  # same tenant, other key
            other = pool.submit(post, base, key_b, chat_body([url("/a2.png")]))  # another tenant
            assert second.status_code == 429, second.text
            err = second.json()["error"]
            assert err["code"] == "image_concurrency_exceeded" and int(second.headers["retry-after"]) >= 1
            assert not routes["/a1.png"].started  # refused before its image was fetched
            assert first.result().status_code == 200, first.result().text
            assert other.result().status_code == 200, other.result().text
        again = post(base, key_a2, chat_body([url("/a3.png")]))  # the slot was given back
        assert again.status_code == 200, again.text
    finally:
        srv.shutdown()
