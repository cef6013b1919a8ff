"""A background response survives ``kill -9`` of the api process that accepted it: the client resumes its stream on
another api process with ``starting_after`` and receives every event exactly once, and the response is billed once.
On a platform of its own (it kills one of its processes)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid

import httpx
import openai
import pytest

from harness import REPO
from tests.support.live import running_platform

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with running_platform(tmp_path_factory.mktemp("responses-drill")) as platform:
        yield platform


def _events(lines) -> list[dict]:
    """The SSE events (``event:`` + ``data:`` pairs) of an iterator of lines, as parsed JSON, as they come."""
    kind = None
    for line in lines:
        if line.startswith("event: "):
            kind = line[len("event: "):]
        elif line.startswith("data: "):
            event = json.loads(line[len("data: "):])
            assert event["type"] == kind
            yield event


def _usage_rows(live, prefix: str) -> list[dict]:
    code = ("import json; from usage.models import UsageRecord; "
            f"print(json.dumps(list(UsageRecord.objects.filter(request_id__startswith='{prefix}').values("
            "'request_id', 'status_code', 'prompt_tokens', 'completion_tokens'))))")
    return json.loads(live.manage("shell", "-c", code).strip().splitlines()[-1])


def _engines(live, ids: list[str]) -> dict[str, str]:
    code = ("import json; from stored_responses.models import StoredResponse; print(json.dumps(dict("
            f"StoredResponse.objects.filter(response_id__in={ids!r}).values_list('response_id', 'engine_id'))))")
    return json.loads(live.manage("shell", "-c", code).strip().splitlines()[-1])


def test_follow_ups_go_to_the_parents_replica_and_hit_its_cache(live) -> None:
    """With two replicas, each turn of a chain is served by the replica that served its parent, and its
    ``cached_tokens`` cover the parent's prompt but for the last partial block (16-token blocks) and the few tokens
    where the parent's generation prompt meets its answer."""
    live.start_engine(name="engine-2")
    assert len(live.replicas(MODEL)) == 2
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, max_retries=0, timeout=60)
    chains = []
    for i in range(4):
        t1 = client.responses.create(model=MODEL, input=f"Story {i}: " + "waves and wind " * 40, max_output_tokens=4)
        t2 = client.responses.create(model=MODEL, previous_response_id=t1.id, input="Go on.", max_output_tokens=4)
        t3 = client.responses.create(model=MODEL, previous_response_id=t2.id, input="More.", max_output_tokens=4)
        for parent, child in ((t1, t2), (t2, t3)):
            covered = (parent.usage.input_tokens // 16 - 1) * 16
            assert child.usage.input_tokens_details.cached_tokens >= covered, (parent.usage, child.usage)
        assert t1.usage.input_tokens_details.cached_tokens == 0  # a new conversation: nothing of it was cached
        chains.append([t1.id, t2.id, t3.id])
    engines = _engines(live, [rid for chain in chains for rid in chain])
    for chain in chains:
        assert len({engines[rid] for rid in chain}) == 1 and engines[chain[0]], engines


def test_kill_9_of_the_accepting_api_mid_stream_then_resume_elsewhere(live) -> None:
    _child, other_url = live.start_api(name="api-2")
    accepting = next(c for c in live.sup.children if c.name == "api")
    client_id = f"drill-{uuid.uuid4().hex[:12]}"
    headers = {"Authorization": f"Bearer {live.api_key}", "X-Request-Id": client_id}
    seen: list[dict] = []
    with httpx.stream("POST", live.base_url + "/v1/responses", headers=headers, timeout=60, json={
            "model": MODEL, "input": "Tell me a long story about the sea.", "background": True, "stream": True,
            "max_output_tokens": 300}) as r:
        assert r.status_code == 200
        for event in _events(r.iter_lines()):
            seen.append(event)
            if event["type"] == "response.output_text.delta" and len(seen) >= 8:
                os.kill(accepting.proc.pid, signal.SIGKILL)
                break
    accepting.proc.wait()
    live.sup.children.remove(accepting)  # killed on purpose: not a child that died on its own
    rid = seen[0]["response"]["id"]
    assert seen[0]["response"]["status"] == "queued"
    with httpx.stream("GET", f"{other_url}/v1/responses/{rid}", timeout=120,
                      headers={"Authorization": f"Bearer {live.api_key}"},
                      params={"stream": "true", "starting_after": seen[-1]["sequence_number"]}) as r:
        assert r.status_code == 200
        rest = list(_events(r.iter_lines()))
    every = seen + rest
    assert [e["sequence_number"] for e in every] == list(range(len(every)))  # each event once, none missing
    assert every[-1]["type"] in ("response.completed", "response.incomplete")
    final = every[-1]["response"]
    got = httpx.get(f"{other_url}/v1/responses/{rid}", headers={"Authorization": f"Bearer {live.api_key}"},
                    timeout=30).json()
    assert got["status"] == final["status"] and got["usage"] == final["usage"]
    text = "".join(e["delta"] for e in every if e["type"] == "response.output_text.delta")
    assert got["output"][0]["content"][0]["text"] == text
    deadline = time.monotonic() + 20
    rows = _usage_rows(live, f"resp_{client_id}")
    while not rows and time.monotonic() < deadline:
        time.sleep(0.5)
        rows = _usage_rows(live, f"resp_{client_id}")
    time.sleep(2)  # a second record would be flushed by now (the usage worker flushes every second)
    rows = _usage_rows(live, f"resp_{client_id}")
    assert len(rows) == 1, rows
    assert rows[0]["completion_tokens"] == final["usage"]["output_tokens"]
    assert rows[0]["prompt_tokens"] == final["usage"]["input_tokens"]


def test_kill_9_of_the_runner_fails_its_response_and_a_new_runner_serves_on(live) -> None:
    """The runner dies mid-generation: another runner takes its pending job over, fails it (its engine work ended
    with the dead runner's link) with an ``error`` event and ``response.failed``, and serves new responses."""
    _child, url = live.start_api(name="api-3")
    client = openai.OpenAI(base_url=url + "/v1", api_key=live.api_key, max_retries=0, timeout=60)
    runner = next(c for c in live.sup.children if c.name == "responses")
    with client.responses.stream(model=MODEL, input="A long story.", background=True, max_output_tokens=300) as s:
        events = iter(s)
        rid = next(events).response.id
        next(e for e in events if e.type == "response.output_text.delta")
    os.kill(runner.proc.pid, signal.SIGKILL)
    runner.proc.wait()
    live.sup.children.remove(runner)
    live.sup.start("responses-2", [sys.executable, str(REPO / "manage.py"), "responses_runner"])
    deadline = time.monotonic() + 60
    while (resp := client.responses.retrieve(rid)).status == "in_progress" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert resp.status == "failed" and resp.error is not None
    replay = list(client.responses.retrieve(rid, stream=True))
    assert [e.sequence_number for e in replay] == list(range(len(replay)))
    assert [e.type for e in replay[-2:]] == ["error", "response.failed"]
    again = client.responses.create(model=MODEL, input="x", background=True, max_output_tokens=2)
    deadline = time.monotonic() + 60
    while (done := client.responses.retrieve(again.id)).status in ("queued", "in_progress") and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert done.status in ("completed", "incomplete")
