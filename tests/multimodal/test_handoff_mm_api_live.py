"""The front api relays image requests to the multimodal api as ``manage.py serve`` runs it (``python -m
ops.mm_api``, here with two workers on one socket): answers equal direct ones, pipelined, ``Expect: 100-continue``
and TLS requests are relayed whole and in order, and a killed worker leaves no client waiting. The relay's other
behaviours (streams, disconnects, a multimodal api that is down or dies) are in test_handoff_live.py."""

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

import httpx
import pytest

from ops.supervisor import port_open, unix_socket_accepts, wait_until
from harness.live_platform import free_port
from harness.assets import VL_MODEL
from harness.images import data_url, image_bytes
from tests.multimodal.test_handoff_live import (IMAGE_TOKEN, assert_same_answer, handoffs, image_messages, post,
                                                fail_with_stacks, stop_child)

OUTCOMES = ("forwarded", "fallback", "failed")


def big_image_messages(seed: int) -> list[dict]:
    """An image chat whose body (481 KB) is larger than one socket read, so it is still arriving when the front
    finds the image part."""
    return [{"role": "user", "content": [
        {"type": "text", "text": "What is in the picture?"},
        {"type": "image_url", "image_url": {"url": data_url(image_bytes(size=(400, 300), seed=seed))}}]}]


def delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in OUTCOMES}


def _start_mm_api(live, sock: str):
    child = live.sup.start("api-mm-workers", [sys.executable, "-m", "ops.mm_api", "--uds", sock, "--workers", "2"])
    wait_until(lambda: unix_socket_accepts(sock), 60, "multimodal api socket", live.sup)
    return child


@pytest.fixture(scope="module")
def relaying(live_vl, tmp_path_factory):
    """``{"base": front URL, "front": child, "mm": child, "sock"}`` over ``live_vl``'s engines."""
    sock = str(tmp_path_factory.mktemp("mm-api") / "mm.sock")
    state = {"sock": sock, "mm": _start_mm_api(live_vl, sock)}
    state["front"], state["base"] = live_vl.start_api("api-front-relay", env_extra={"MULTIMODAL_API_SOCKET": sock})
    yield state
    stop_child(live_vl, state["front"])
    if state["mm"] in live_vl.sup.children:
        stop_child(live_vl, state["mm"])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/v1/chat/completions/render"])
def test_relayed_answers_equal_direct_ones(live_vl, relaying, path):
    """Errors (status, envelope) and results equal those of an api serving the request itself; a wrong key is
    refused with the same 401 by the front itself, from the headers, before any of the body is read or the
    request relayed (issue 14); a relayed request is still authenticated by the multimodal api (the good and
    bad bodies above are served there with the key checked again)."""
    broken = data_url(image_bytes("PNG", size=(400, 300), seed=53)[:-5000])  # truncated: a 400 naming the part
    bad = {"model": VL_MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": broken}}]}]}
    good = {"model": VL_MODEL, "messages": big_image_messages(54)}
    before = handoffs(live_vl)
    for body in (bad, good):
        if path == "/v1/chat/completions" and body is good:
            continue  # generated text differs per request; covered in test_handoff_live.py
        assert_same_answer(live_vl, relaying["base"], path, body)
    wrong = post(relaying["base"], "sk-wrong", path, good)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    n = 1 if path == "/v1/chat/completions" else 2  # the wrong key's request is not relayed
    assert delta(before, handoffs(live_vl)) == {"forwarded": n, "fallback": 0, "failed": 0}


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
                time.sleep(0.1)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    return reply


def test_whole_pipelined_and_chunked_bodies_are_relayed(live_vl, relaying):
    """A small image chat that arrived whole with its headers is relayed. When a second request follows it in the
    same write (pipelining), the front relays the first and answers both, in order. A chunked body is relayed."""
    port = int(relaying["base"].rsplit(":", 1)[1])
    small = json.dumps({"model": VL_MODEL, "max_tokens": 1, "messages": image_messages(57)}).encode()
    before = handoffs(live_vl)
    reply = _raw_request(port, live_vl.api_key, small)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    assert delta(before, handoffs(live_vl)) == {"forwarded": 1, "fallback": 0, "failed": 0}

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
    assert delta(before, handoffs(live_vl)) == {"forwarded": 1, "fallback": 0, "failed": 0}

    def chunked():
        raw = json.dumps({"model": VL_MODEL, "max_tokens": 1, "messages": big_image_messages(58)}).encode()
        for i in range(0, len(raw), 100_000):
            yield raw[i:i + 100_000]

    before = handoffs(live_vl)
    r = httpx.post(relaying["base"] + "/v1/chat/completions", content=chunked(), timeout=60,
                   headers={"Authorization": f"Bearer {live_vl.api_key}", "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert delta(before, handoffs(live_vl)) == {"forwarded": 1, "fallback": 0, "failed": 0}


def test_expect_100_continue_is_answered_once(live_vl, relaying):
    """The front answers ``100 Continue``; the request it relays carries no ``Expect``, so the multimodal api
    does not answer a second one into the response."""
    port = int(relaying["base"].rsplit(":", 1)[1])
    raw = json.dumps({"model": VL_MODEL, "max_tokens": 1, "messages": big_image_messages(59)}).encode()
    before = handoffs(live_vl)
    reply = _raw_request(port, live_vl.api_key, raw, b"Expect: 100-continue\r\n", pieces=4)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    assert b"100 Continue" not in reply
    assert delta(before, handoffs(live_vl))["forwarded"] == 1


def test_pipelined_image_chat_behind_a_large_unread_answer_arrives_in_order(live_vl, relaying):
    """A pipelining client that reads slowly: the front still holds much of the first answer in its write buffer
    when the image chat behind it is read and relayed: both answers arrive whole and in order."""
    port = int(relaying["base"].rsplit(":", 1)[1])
    auth = b"Authorization: Bearer " + live_vl.api_key.encode() + b"\r\n"

    def request(path: bytes, body: bytes) -> bytes:
        return (b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + auth
                + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    # an answer of ~2.4 MB: more than the kernel's socket buffers hold, so the rest waits at the front (a
    # /detokenize of 400,000 tokens: a prompt that long would be refused before tokenizing)
    hello = httpx.post(live_vl.base_url + "/tokenize", headers={"Authorization": f"Bearer {live_vl.api_key}"},
                       json={"model": VL_MODEL, "prompt": " hello", "add_special_tokens": False}, timeout=60).json()
    big = request(b"/detokenize", json.dumps({"model": VL_MODEL, "tokens": hello["tokens"] * 400_000}).encode())
    image = request(b"/v1/chat/completions", json.dumps({"model": VL_MODEL, "max_tokens": 1,
                                                         "messages": big_image_messages(63)}).encode())
    before = handoffs(live_vl)
    with socket.socket() as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.settimeout(60)
        conn.connect(("127.0.0.1", port))
        conn.sendall(big + image[:len(image) // 4])
        time.sleep(1.5)  # the first answer is being written; the image chat is read up to its image part
        conn.sendall(image[len(image) // 4:])
        data = bytearray()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (data.count(b"HTTP/1.1 ") < 2 or not data.rstrip().endswith(b"}")):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
            if len(data) < 4_000_000:
                time.sleep(0.002)  # slowly at first, so the front's buffer stays full
    head, _, rest = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    first = json.loads(rest[:length])
    assert first["prompt"] == " hello" * 400_000
    second = rest[length:]
    assert second.startswith(b"HTTP/1.1 200"), second[:200]
    assert delta(before, handoffs(live_vl)) == {"forwarded": 1, "fallback": 0, "failed": 0}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command for a test certificate")
def test_a_tls_connection_is_relayed(live_vl, relaying, tmp_path):
    """Over HTTPS the image chat is relayed (and answered) too."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-subj", "/CN=127.0.0.1", "-days", "1"], check=True, capture_output=True, timeout=60)
    port = free_port()
    child = live_vl.sup.start("api-front-tls", [
        sys.executable, "-m", "uvicorn", "config.asgi:application", "--host", "127.0.0.1", "--port", str(port),
        "--no-access-log", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)],
        env_extra={"MULTIMODAL_API_SOCKET": relaying["sock"]})
    try:
        wait_until(lambda: port_open("127.0.0.1", port), 60, "the TLS front api", live_vl.sup)
        before = handoffs(live_vl)
        r = httpx.post(f"https://127.0.0.1:{port}/tokenize", verify=False, timeout=60,
                       headers={"Authorization": f"Bearer {live_vl.api_key}"},
                       json={"model": VL_MODEL, "messages": big_image_messages(70)})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"].count(IMAGE_TOKEN) > 6
        assert delta(before, handoffs(live_vl)) == {"forwarded": 1, "fallback": 0, "failed": 0}
    finally:
        stop_child(live_vl, child)


def _listening_inode(path: str) -> str:
    """The inode of the socket listening on ``path``: the entry with ``__SO_ACCEPTCON`` (0x10000) in its flags. A
    connection accepted on that socket (the front's kept-alive relay connection) is listed with the same path."""
    for line in open("/proc/net/unix").read().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[7] == path and int(fields[3], 16) & 0x10000:
            return fields[6]
    raise AssertionError(f"{path} is not a listening socket")


def test_sigusr2_writes_every_threads_stack_to_the_api_log_and_the_api_goes_on(live_vl, relaying):
    """``kill -USR2`` of an api process dumps its Python stacks to its log (faulthandler, config/asgi.py): what a
    process that will not stop shows (``fail_with_stacks``); the process keeps serving."""
    front = relaying["front"]
    before = front.log_path.stat().st_size
    os.kill(front.proc.pid, signal.SIGUSR2)
    # faulthandler writes the dump line by line: wait for the frames of the thread running uvicorn, not merely for
    # the "Current thread" line (a read between the two saw a partial dump)
    wait_until(lambda: all(s in front.log_path.read_text(errors="replace")[before:] for s in ("Current thread", "uvicorn")),
               10, "the stack dump with the api's uvicorn frames")
    r = httpx.get(relaying["base"] + "/health", timeout=10)
    assert r.status_code == 200 and front.proc.poll() is None


def test_killing_one_multimodal_worker_leaves_no_client_waiting(live_vl, relaying):
    """kill -9 of one of the two workers stops the multimodal api (its supervisor restarts it whole); image chats
    sent meanwhile are served. The launcher holds no copy of the listening socket: once the surviving worker begins
    its graceful shutdown (which closes its copy first), a connection is refused at once and the front serves the
    request, instead of waiting on a socket nobody accepts from until the launcher exits."""
    parent = relaying["mm"].proc.pid
    inode = _listening_inode(relaying["sock"])
    held = lambda pid: any(os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]"
                           for fd in os.listdir(f"/proc/{pid}/fd"))

    def workers_now() -> list[int]:
        children = [int(p) for p in open(f"/proc/{parent}/task/{parent}/children").read().split()]
        return [p for p in children if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]

    # both workers are up and hold the listening socket (they may still be starting on a loaded machine)
    wait_until(lambda: len(workers_now()) == 2 and all(held(p) for p in workers_now()), 60,
               "both multimodal workers holding the socket")
    workers = workers_now()
    assert not held(parent)
    os.kill(workers[0], signal.SIGKILL)
    before = handoffs(live_vl)
    for seed in (64, 65, 66, 67):
        r = post(relaying["base"], live_vl.api_key, "/v1/chat/completions",
                 {"model": VL_MODEL, "messages": big_image_messages(seed), "max_tokens": 1})
        assert r.status_code == 200, r.text
        time.sleep(0.3)
    d = delta(before, handoffs(live_vl))
    assert d["failed"] == 0 and d["forwarded"] + d["fallback"] == 4, d
    try:
        relaying["mm"].proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        fail_with_stacks(relaying["mm"])
    live_vl.sup.children.remove(relaying["mm"])
    relaying["mm"] = _start_mm_api(live_vl, relaying["sock"])
