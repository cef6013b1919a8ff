"""A fake engine link and a fake SSE consumer for unit tests of the gateway's pipeline (tests/pipeline): the
engine adds nothing to what those tests check, real Redis does the rest."""

from __future__ import annotations

from dataclasses import dataclass, field

from inference.protocol.engine import EngineCoreOutput


@dataclass
class FakeLink:
    """The engine link's surface the pipeline uses (``EngineLink``: ``client_id``, ``add_requests``, ``abort``,
    ``release``). ``script`` maps the last two characters of a child's request id (``"-0"``, ``"-1"``) to the
    ``EngineCoreOutput`` fields it answers with, in order; ``default`` answers any other request. ``added``,
    ``aborted`` and ``released`` record the ids the pipeline passed."""

    script: dict = field(default_factory=dict)
    default: list = field(default_factory=list)
    client_id: str = "fake"
    added: list = field(default_factory=list)
    aborted: list = field(default_factory=list)
    released: list = field(default_factory=list)

    async def add_requests(self, model, requests, queue):
        for r in requests:
            self.added.append(r.request_id)
            for out in self.script.get(r.request_id[-2:], self.default):
                queue.put_nowait(EngineCoreOutput(r.request_id, **out))

    async def abort(self, model, ids):
        self.aborted.extend(ids)

    def release(self, rid):
        self.released.append(rid)


class FakeConsumer:
    """What ``responses.stream`` and the key limits need of a ``GatewayConsumer``; ``events`` records the SSE
    stream (``"start"``, each payload, ``"done"``)."""

    def __init__(self):
        self.extra_headers = []
        self.events = []

    async def start_sse(self):
        self.events.append("start")

    async def send_event(self, payload):
        self.events.append(payload)

    async def end_sse(self):
        self.events.append("done")
