"""Usage: one record per request, whatever its end, written off the event loop (issue 2 / docs/ARCHITECTURE.md §7)."""

from __future__ import annotations

import json
import time
import uuid

import httpx

from tests.engine_tap import EngineTap, assert_engine_aborted


def records(live, prefix: str, want: int, timeout: float = 15.0) -> list[dict]:
    """Usage rows whose request id starts with ``prefix`` (waits for the batched flush)."""
    code = ("import json; from usage.models import UsageRecord; "
            f"print(json.dumps(list(UsageRecord.objects.filter(request_id__startswith='{prefix}').values("
            "'request_id','status_code','finish_reason','prompt_tokens','completion_tokens','ttft_ms',"
            "'e2e_latency_ms','served_model_name','api_key_id','tenant_id'))))")
    deadline = time.monotonic() + timeout
    rows: list[dict] = []
    while time.monotonic() < deadline:
        rows = json.loads(live.manage("shell", "-c", code).strip().splitlines()[-1])
        if len(rows) >= want:
            return rows
        time.sleep(0.5)
    return rows


def test_usage_recorded_for_success_error_and_abort(live, model_name):
    tag = uuid.uuid4().hex[:8]
    h = {"Authorization": f"Bearer {live.api_key}"}
    ok = httpx.post(live.base_url + "/v1/chat/completions", headers={**h, "X-Request-Id": f"ok-{tag}"}, timeout=60,
                    json={"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                          "ignore_eos": True})
    assert ok.status_code == 200
    bad = httpx.post(live.base_url + "/v1/chat/completions", headers={**h, "X-Request-Id": f"bad-{tag}"},
                     timeout=60, json={"model": model_name, "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": live.max_model_len})
    assert bad.status_code == 400
    long = live.max_model_len - 64  # ignore_eos: only the abort can end it before this many tokens
    with EngineTap(live.redis_url, live.prefix) as tap, httpx.Client(timeout=60) as http:
        with http.stream("POST", live.base_url + "/v1/chat/completions",
                         headers={**h, "X-Request-Id": f"gone-{tag}"},
                         json={"model": model_name, "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": long, "ignore_eos": True, "stream": True}) as resp:
            lines = resp.iter_lines()
            got = 0
            while got < 3:
                got += next(lines).startswith("data: ")
        # not only booked by the gateway: the engine itself ended the request with abort, before ``long``
        assert_engine_aborted(tap, f"gone-{tag}", long)

    (row,) = records(live, f"chatcmpl-ok-{tag}", 1)
    assert row["status_code"] == 200 and row["finish_reason"] == "length"
    assert row["completion_tokens"] == 5 and row["prompt_tokens"] == ok.json()["usage"]["prompt_tokens"]
    assert row["ttft_ms"] is not None and row["e2e_latency_ms"] >= row["ttft_ms"] > 0
    assert row["served_model_name"] == model_name and row["api_key_id"] and row["tenant_id"]

    (row,) = records(live, f"chatcmpl-bad-{tag}", 1)
    assert row["status_code"] == 400 and row["completion_tokens"] == 0

    (row,) = records(live, f"chatcmpl-gone-{tag}", 1)
    assert row["status_code"] == 499 and row["finish_reason"] == "abort"
    assert 1 <= row["completion_tokens"] < long
