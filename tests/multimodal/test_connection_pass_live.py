"""The front api passes the client connection of an image request to the multimodal api (gateway/connection_pass.py),
as ``manage.py serve`` runs them (``python -m ops.mm_api``, here with two workers): the multimodal api answers on
the client's own connection, keeps serving it afterwards, and the front does no more work for it; requests that
cannot be passed are relayed or served by the front as before."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from ops.supervisor import port_open, unix_socket_accepts, wait_until
from tests.engine_tap import EngineTap, assert_engine_aborted
from tests.live_platform import free_port
from tests.multimodal.conftest import VL_MODEL
from tests.multimodal.imgs import data_url, image_bytes
from tests.multimodal.servers import wait_server_read
from tests.multimodal.test_handoff_live import (IMAGE_TOKEN, admission_idle, assert_same_answer, engine_idle,
                                                handoffs, image_messages, post, stop_child, stream_image_chat)

OUTCOMES = ("passed", "forwarded", "fallback", "failed")


def big_image_messages(seed: int) -> list[dict]:
    """An image chat whose body (481 KB) is larger than one socket read, so it is still arriving when the front
    finds the image part."""
    return [{"role": "user", "content": [
        {"type": "text", "text": "What is in the picture?"},
        {"type": "image_url", "image_url": {"url": data_url(image_bytes(size=(400, 300), seed=seed))}}]}]


def delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in OUTCOMES}


def _start_mm_api(live, sock: str, pass_sock: str):
    child = live.sup.start("api-mm-pass", [sys.executable, "-m", "ops.mm_api", "--uds", sock, "--pass-socket",
                                           pass_sock, "--workers", "2"])
    wait_until(lambda: unix_socket_accepts(sock) and unix_socket_accepts(pass_sock), 60, "multimodal api sockets",
               live.sup)
    return child


@pytest.fixture(scope="module")
def passing(live_vl, tmp_path_factory):
    """``{"base": front URL, "front": child, "mm": child, "sock", "pass_sock"}`` over ``live_vl``'s engines."""
    d = tmp_path_factory.mktemp("mm-pass")
    sock, pass_sock = str(d / "mm.sock"), str(d / "pass.sock")
    state = {"sock": sock, "pass_sock": pass_sock, "mm": _start_mm_api(live_vl, sock, pass_sock)}
    state["front"], state["base"] = live_vl.start_api("api-front-pass", env_extra={
        "MULTIMODAL_API_SOCKET": sock, "MULTIMODAL_PASS_SOCKET": pass_sock})
    yield state
    stop_child(live_vl, state["front"])
    if state["mm"] in live_vl.sup.children:
        stop_child(live_vl, state["mm"])


def test_passed_connection_is_served_by_the_multimodal_api_from_then_on(live_vl, passing):
    base = passing["base"]
    headers = {"Authorization": f"Bearer {live_vl.api_key}"}
    before = handoffs(live_vl)
    body = {"model": VL_MODEL, "messages": big_image_messages(51), "max_tokens": 2, "return_token_ids": True}
    with httpx.Client(timeout=30, headers=headers) as http:
        r = http.post(base + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["prompt_token_ids"].count(IMAGE_TOKEN) > 6
        assert delta(before, handoffs(live_vl)) == {"passed": 1, "forwarded": 0, "fallback": 0, "failed": 0}
        direct = post(live_vl.base_url, live_vl.api_key, "/v1/chat/completions", body)
        assert direct.json()["prompt_token_ids"] == r.json()["prompt_token_ids"]
        # the front api is frozen: a new connection to it gets nothing, the passed one is still answered
        os.killpg(passing["front"].proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(httpx.TimeoutException):
                httpx.post(base + "/tokenize", json={"model": VL_MODEL, "prompt": "hi"}, headers=headers, timeout=1)
            for _ in range(3):
                tok = http.post(base + "/tokenize", json={"model": VL_MODEL, "prompt": "hello"})
                assert tok.status_code == 200 and tok.json()["count"] >= 1
            again = http.post(base + "/v1/chat/completions", json=body)
            assert again.status_code == 200 and again.json()["prompt_token_ids"] == r.json()["prompt_token_ids"]
        finally:
            os.killpg(passing["front"].proc.pid, signal.SIGCONT)
    # one pass per connection: the later requests on it were not handed off again
    assert delta(before, handoffs(live_vl))["passed"] == 1
    metrics_key = live_vl.new_key(scopes="metrics")
    text_metrics = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {metrics_key}"}).text
    assert f'gateway_handoffs_total{{outcome="passed"}} {float(handoffs(live_vl)["passed"])}' in text_metrics


def test_streamed_image_chat_on_a_passed_connection(live_vl, passing):
    before = handoffs(live_vl)
    stream_image_chat(passing["base"], live_vl.api_key, big_image_messages(52))
    assert delta(before, handoffs(live_vl))["passed"] == 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/v1/chat/completions/render"])
def test_answers_on_passed_connections_equal_direct_ones(live_vl, passing, path):
    """Errors (status, envelope) and results equal those of an api serving the request itself; a wrong key is
    refused with the same 401 by the front itself, from the headers, before any of the body is read or the
    connection passed (issue 14); a passed request is still authenticated by the multimodal api (the good and
    bad bodies above are served there with the key checked again)."""
    broken = data_url(image_bytes("PNG", size=(400, 300), seed=53)[:-5000])  # truncated: a 400 naming the part
    bad = {"model": VL_MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": broken}}]}]}
    good = {"model": VL_MODEL, "messages": big_image_messages(54)}
    before = handoffs(live_vl)
    for body in (bad, good):
        if path == "/v1/chat/completions" and body is good:
            continue  # generated text differs per request; covered above
        assert_same_answer(live_vl, passing["base"], path, body)
    wrong = post(passing["base"], "sk-wrong", path, good)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    n = 1 if path == "/v1/chat/completions" else 2  # the wrong key's request is not passed
    assert delta(before, handoffs(live_vl)) == {"passed": n, "forwarded": 0, "fallback": 0, "failed": 0}


def test_client_disconnect_on_a_passed_connection_aborts_the_request(live_vl, passing):
    body = {"model": VL_MODEL, "messages": big_image_messages(55), "max_tokens": 800, "stream": True,
            "ignore_eos": True}  # max_model_len 1024: with ignore_eos only an abort ends it before 800 tokens
    tag = uuid.uuid4().hex[:10]
    before = handoffs(live_vl)
    with EngineTap(live_vl.redis_url, live_vl.prefix) as tap, httpx.Client(timeout=60) as http:
        with http.stream("POST", passing["base"] + "/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {live_vl.api_key}", "X-Request-Id": tag}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = 0
            while got < 2:
                got += next(lines).startswith("data: ")
        # the engine itself ended the request with abort, before its max_tokens
        assert_engine_aborted(tap, tag, body["max_tokens"])
    assert delta(before, handoffs(live_vl))["passed"] == 1  # it was the passed connection that went away
    wait_until(lambda: engine_idle(live_vl), 30, "engine idle")
    wait_until(lambda: admission_idle(live_vl), 30, "admission released")


def test_large_body_on_a_passed_connection(live_vl, passing):
    """A 4.3 MB image body: the multimodal api reads the rest of it from the client's socket."""
    body = {"model": VL_MODEL, "max_tokens": 1, "return_token_ids": True, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image_bytes(size=(1200, 900), seed=56))}},
        {"type": "text", "text": "describe"}]}]}
    before = handoffs(live_vl)
    r = post(passing["base"], live_vl.api_key, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert delta(before, handoffs(live_vl))["passed"] == 1
    direct = post(live_vl.base_url, live_vl.api_key, "/v1/chat/completions", body)
    assert direct.json()["prompt_token_ids"] == r.json()["prompt_token_ids"]


def _raw_request(port: int, key: str, raw: bytes, extra_headers: bytes = b"", pieces: int = 1) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + key.encode() + b"\r\nConnection: close\r\n" + extra_headers +
                b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n")
        if pieces == 1:
            conn.sendall(head + raw)
        else:
            conn.sendall(head)
            if b"100-continue" in extra_headers:
                assert conn.recv(100).startswith(b"HTTP/1.1 100 Continue"), "no 100 Continue"
            step = len(raw) // pieces + 1
            for i in range(0, len(raw), step):
                conn.sendall(raw[i:i + step])
                wait_server_read(conn)  # each piece is read on its own
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    return reply


def test_a_body_that_arrived_whole_is_passed_a_pipelined_one_relayed(live_vl, passing):
    """A small image chat that arrived whole with its headers is passed too. When a second request follows it in
    the same write (pipelining), the front has already read part of that one: it relays the first and answers
    both itself, in order. A chunked body is relayed."""
    port = int(passing["base"].rsplit(":", 1)[1])
    small = json.dumps({"model": VL_MODEL, "max_tokens": 1, "messages": image_messages(57)}).encode()
    before = handoffs(live_vl)
    reply = _raw_request(port, live_vl.api_key, small)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    assert delta(before, handoffs(live_vl)) == {"passed": 1, "forwarded": 0, "fallback": 0, "failed": 0}

    tok = json.dumps({"model": VL_MODEL, "prompt": "hello"}).encode()
    head = (b"Host: 127.0.0.1\r\nContent-Type: application/json\r\nAuthorization: Bearer " + live_vl.api_key.encode()
            + b"\r\nContent-Length: ")
    before = handoffs(live_vl)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n" + head + str(len(small)).encode() + b"\r\n\r\n" + small
                     + b"POST /tokenize HTTP/1.1\r\n" + head + str(len(tok)).encode()
                     + b"\r\nConnection: close\r\n\r\n" + tok)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    first, second = reply.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200") and b'"chat.completion"' in first, first[:300]
    assert second.startswith(b"200") and b'"tokens"' in second, second[:300]
    assert delta(before, handoffs(live_vl)) == {"passed": 0, "forwarded": 1, "fallback": 0, "failed": 0}

    def chunked():
        raw = json.dumps({"model": VL_MODEL, "max_tokens": 1, "messages": big_image_messages(58)}).encode()
        for i in range(0, len(raw), 100_000):
            yield raw[i:i + 100_000]

    before = handoffs(live_vl)
    r = httpx.post(passing["base"] + "/v1/chat/completions", content=chunked(), timeout=60,
                   headers={"Authorization": f"Bearer {live_vl.api_key}", "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert delta(before, handoffs(live_vl)) == {"passed": 0, "forwarded": 1, "fallback": 0, "failed": 0}


def test_expect_100_continue_is_answered_once(live_vl, passing):
    """The front answers ``100 Continue``; the request it passes on carries no ``Expect``, so the multimodal api
    does not answer a second one into the response."""
    port = int(passing["base"].rsplit(":", 1)[1])
    raw = json.dumps({"model": VL_MODEL, "max_tokens": 1, "messages": big_image_messages(59)}).encode()
    before = handoffs(live_vl)
    reply = _raw_request(port, live_vl.api_key, raw, b"Expect: 100-continue\r\n", pieces=4)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    assert b"100 Continue" not in reply
    assert delta(before, handoffs(live_vl))["passed"] == 1


def test_pass_is_skipped_while_the_multimodal_api_is_down(live_vl, passing):
    """Passing and relaying both fail fast while the multimodal api is down: the front serves the request itself;
    once it is back, connections are passed again."""
    stop_child(live_vl, passing["mm"], signal.SIGKILL)
    before = handoffs(live_vl)
    r = post(passing["base"], live_vl.api_key, "/v1/chat/completions",
             {"model": VL_MODEL, "messages": big_image_messages(60), "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert delta(before, handoffs(live_vl)) == {"passed": 0, "forwarded": 0, "fallback": 1, "failed": 0}
    passing["mm"] = _start_mm_api(live_vl, passing["sock"], passing["pass_sock"])
    before = handoffs(live_vl)
    r = post(passing["base"], live_vl.api_key, "/v1/chat/completions",
             {"model": VL_MODEL, "messages": big_image_messages(61), "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert delta(before, handoffs(live_vl)) == {"passed": 1, "forwarded": 0, "fallback": 0, "failed": 0}


def test_a_hung_multimodal_api_costs_a_bounded_delay_not_the_front(live_vl, passing):
    """With the multimodal api stopped (SIGSTOP), a pass is given up after ``PASS_DEADLINE_S + ADOPT_GRACE_S`` and
    the front serves the request itself; text requests on the front are not held up meanwhile. Once the multimodal
    api runs again it refuses the stale pass (its deadline is gone) instead of answering a second time."""
    import concurrent.futures

    from gateway.connection_pass import PASS_DEADLINE_S

    body = {"model": VL_MODEL, "messages": big_image_messages(62), "max_tokens": 1}
    before = handoffs(live_vl)
    os.killpg(passing["mm"].proc.pid, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            t0 = time.monotonic()
            pending = pool.submit(post, passing["base"], live_vl.api_key, "/v1/chat/completions", body)
            time.sleep(1)
            tok = post(passing["base"], live_vl.api_key, "/tokenize", {"model": VL_MODEL, "prompt": "hello"})
            assert tok.status_code == 200 and not pending.done()  # answered while the image chat still waits
            r = pending.result(timeout=120)  # answered while the multimodal api is still stopped
            waited = time.monotonic() - t0
    finally:
        os.killpg(passing["mm"].proc.pid, signal.SIGCONT)
    assert r.status_code == 200, r.text
    assert PASS_DEADLINE_S <= waited, waited  # the pass was waited for up to its deadline, then given up
    time.sleep(1)  # the resumed multimodal api refuses the stale pass: counted nowhere, answered nowhere
    assert delta(before, handoffs(live_vl)) == {"passed": 0, "forwarded": 0, "fallback": 1, "failed": 0}
    wait_until(lambda: admission_idle(live_vl), 10, "admission idle")
    r = post(passing["base"], live_vl.api_key, "/v1/chat/completions", body | {"messages": big_image_messages(71)})
    assert r.status_code == 200, r.text


def test_pipelined_image_chat_behind_a_large_unread_answer_is_not_passed(live_vl, passing):
    """A pipelining client that reads slowly: the front still holds much of the first answer in its write buffer
    when the image chat behind it is read. Passed, the multimodal api's answer would land inside the first one;
    relayed, both arrive whole and in order."""
    port = int(passing["base"].rsplit(":", 1)[1])
    auth = b"Authorization: Bearer " + live_vl.api_key.encode() + b"\r\n"

    def request(path: bytes, body: bytes) -> bytes:
        return (b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + auth
                + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    # an answer of ~8 MB: more than the kernel's socket buffers hold, so the rest waits at the front
    big = request(b"/tokenize", json.dumps({"model": VL_MODEL, "prompt": " hello" * 400_000,
                                            "return_token_strs": True}).encode())
    image = request(b"/v1/chat/completions", json.dumps({"model": VL_MODEL, "max_tokens": 1,
                                                         "messages": big_image_messages(63)}).encode())
    before = handoffs(live_vl)
    with socket.socket() as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.settimeout(60)
        conn.connect(("127.0.0.1", port))
        conn.sendall(big + image[:len(image) // 4])
        # the first answer is being written (the front holds a backlog); the image chat is read up to its image part
        wait_server_read(conn, backlog=True)
        conn.sendall(image[len(image) // 4:])
        data = bytearray()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (data.count(b"HTTP/1.1 ") < 2 or not data.rstrip().endswith(b"}")):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
            if len(data) < 4_000_000:
                time.sleep(0.002)  # slowly at first, so the front's buffer stays full while the pass is tried
    head, _, rest = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    first = json.loads(rest[:length])
    assert first["count"] == 400_000
    second = rest[length:]
    assert second.startswith(b"HTTP/1.1 200"), second[:200]
    assert delta(before, handoffs(live_vl)) == {"passed": 0, "forwarded": 1, "fallback": 0, "failed": 0}


def _tcp_socket_fds(pid: int) -> dict[str, int]:
    """``{fd: flags}`` of the TCP sockets ``pid`` holds."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        inodes |= {line.split()[9] for line in open(table).read().splitlines()[1:]}
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            flags = int(open(f"/proc/{pid}/fdinfo/{fd}").read().split("flags:")[1].split()[0], 8)
        except (OSError, IndexError):
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            out[fd] = flags
    return out


def test_an_adopted_connection_is_not_inherited_by_child_processes(live_vl, passing):
    parent = passing["mm"].proc.pid
    workers = [int(p) for p in open(f"/proc/{parent}/task/{parent}/children").read().split()]
    before = handoffs(live_vl)
    with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {live_vl.api_key}"}) as http:
        r = http.post(passing["base"] + "/tokenize", json={"model": VL_MODEL, "messages": big_image_messages(69)})
        assert r.status_code == 200, r.text
        held = {pid: _tcp_socket_fds(pid) for pid in workers}
    # a connection was adopted at all (without a pass the check below would only see Redis/database sockets)
    assert delta(before, handoffs(live_vl))["passed"] == 1
    # the client's connection (plus the workers' Redis and database connections) all close on exec
    assert sum(len(fds) for fds in held.values()) >= 1
    assert all(flags & os.O_CLOEXEC for fds in held.values() for flags in fds.values()), held


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command for a test certificate")
def test_a_tls_connection_is_relayed_not_passed(live_vl, passing, tmp_path):
    """A TLS session cannot move to another process: over HTTPS the image chat is relayed (and answered)."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-subj", "/CN=127.0.0.1", "-days", "1"], check=True, capture_output=True, timeout=60)
    port = free_port()
    child = live_vl.sup.start("api-front-tls", [
        sys.executable, "-m", "uvicorn", "config.asgi:application", "--host", "127.0.0.1", "--port", str(port),
        "--no-access-log", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)],
        env_extra={"MULTIMODAL_API_SOCKET": passing["sock"], "MULTIMODAL_PASS_SOCKET": passing["pass_sock"]})
    try:
        wait_until(lambda: port_open("127.0.0.1", port), 60, "the TLS front api", live_vl.sup)
        before = handoffs(live_vl)
        r = httpx.post(f"https://127.0.0.1:{port}/tokenize", verify=False, timeout=60,
                       headers={"Authorization": f"Bearer {live_vl.api_key}"},
                       json={"model": VL_MODEL, "messages": big_image_messages(70)})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"].count(IMAGE_TOKEN) > 6
        assert delta(before, handoffs(live_vl)) == {"passed": 0, "forwarded": 1, "fallback": 0, "failed": 0}
    finally:
        stop_child(live_vl, child)


def _listening_inode(path: str) -> str:
    for line in open("/proc/net/unix").read().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[7] == path:
            return fields[6]
    raise AssertionError(f"{path} is not a listening socket")


def test_killing_one_multimodal_worker_leaves_no_client_waiting(live_vl, passing):
    """kill -9 of one of the two workers stops the multimodal api (its supervisor restarts it whole); image chats
    sent meanwhile are served. The launcher holds no copy of the pass socket: once the surviving worker begins
    its graceful shutdown (which closes its copy first), a pass is refused at once and the front serves the
    request, instead of waiting on a socket nobody accepts from until the launcher exits."""
    parent = passing["mm"].proc.pid
    children = [int(p) for p in open(f"/proc/{parent}/task/{parent}/children").read().split()]
    workers = [p for p in children if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
    assert len(workers) == 2
    inode = _listening_inode(passing["pass_sock"])
    held = lambda pid: any(os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]"  # noqa: E731
                           for fd in os.listdir(f"/proc/{pid}/fd"))
    assert held(workers[0]) and held(workers[1]) and not held(parent)
    os.kill(workers[0], signal.SIGKILL)
    before = handoffs(live_vl)
    for seed in (64, 65, 66, 67):
        r = post(passing["base"], live_vl.api_key, "/v1/chat/completions",
                 {"model": VL_MODEL, "messages": big_image_messages(seed), "max_tokens": 1})
        assert r.status_code == 200, r.text
        time.sleep(0.3)
    d = delta(before, handoffs(live_vl))
    assert d["failed"] == 0 and d["passed"] + d["fallback"] == 4, d
    passing["mm"].proc.wait(timeout=30)
    live_vl.sup.children.remove(passing["mm"])
    passing["mm"] = _start_mm_api(live_vl, passing["sock"], passing["pass_sock"])
