"""gateway.ingress.BodyDeadline in process: the body's idle and total deadlines (408 and a disconnect), and the
server's ``receive`` passed through untouched once the body is complete."""

from __future__ import annotations

import asyncio
import json

from gateway.ingress import BodyDeadline


class Client:
    """The server side of one request: body chunks handed out as they are ``arrive``d; ``send`` records messages."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict] = asyncio.Queue()
        self.sent: list[dict] = []

    def arrive(self, body: bytes, more: bool) -> None:
        self.queue.put_nowait({"type": "http.request", "body": body, "more_body": more})

    async def receive(self) -> dict:
        return await self.queue.get()

    async def send(self, message: dict) -> None:
        self.sent.append(message)


async def test_idle_body_gets_408_and_a_disconnect():
    client = Client()
    deadline = BodyDeadline(client.receive, client.send, total_s=5, idle_s=0.1)
    client.arrive(b"{", True)
    assert (await deadline())["body"] == b"{"
    t0 = asyncio.get_running_loop().time()
    assert await deadline() == {"type": "http.disconnect"}  # nothing more for 0.1 s
    assert 0.09 <= asyncio.get_running_loop().time() - t0 < 2
    assert deadline.timed_out and client.sent[0]["status"] == 408
    assert json.loads(client.sent[1]["body"])["error"]["code"] == "request_timeout"
    assert await deadline() == {"type": "http.disconnect"}  # and stays so


async def test_total_deadline_counts_across_chunks():
    client = Client()
    deadline = BodyDeadline(client.receive, client.send, total_s=0.3, idle_s=0.2)

    async def trickle() -> None:
        for _ in range(10):
            await asyncio.sleep(0.1)
            client.arrive(b"x", True)

    feeder = asyncio.create_task(trickle())
    got = []
    while (msg := await deadline())["type"] == "http.request":
        got.append(msg)
    feeder.cancel()
    assert 1 <= len(got) <= 4 and deadline.timed_out and client.sent[0]["status"] == 408


async def test_complete_body_then_receive_passes_through():
    client = Client()
    deadline = BodyDeadline(client.receive, client.send, total_s=0.05, idle_s=0.05)
    client.arrive(b"{}", False)
    assert (await deadline())["more_body"] is False
    await asyncio.sleep(0.1)  # past both deadlines: they no longer apply
    client.queue.put_nowait({"type": "http.disconnect"})
    assert await deadline() == {"type": "http.disconnect"}
    assert not deadline.timed_out and client.sent == []
