"""U+0000 in any string field of a request never breaks the usage batch (issue 17; PostgreSQL text cannot hold NUL,
D-175): every request carrying NULs gets its usage record, and so do the requests flushed in the same batch."""

from __future__ import annotations

import uuid

import httpx

from tests.e2e.test_usage_e2e import records

NUL = "\x00"


def test_nul_in_every_string_field_leaves_the_usage_batch_whole(live, model_name):
    tag = uuid.uuid4().hex[:8]
    h = {"Authorization": f"Bearer {live.api_key}"}
    tool = {"type": "function", "function": {"name": "get_weather", "description": f"d{NUL}",  # a name is 1-64 of [A-Za-z0-9_-]
                                             "parameters": {"type": "object", "properties": {
                                                 f"ci{NUL}ty": {"type": "string"}}}}}
    sent = {
        "chat": ("/v1/chat/completions", {
            "model": model_name, "max_tokens": 4, "user": f"u{NUL}ser", "stop": [f"st{NUL}op"], "tools": [tool],
            "messages": [{"role": "system", "content": f"sys{NUL}tem"},
                         {"role": "user", "content": [{"type": "text", "text": f"he{NUL}llo"}], "name": f"n{NUL}"}]}),
        "chat-stream": ("/v1/chat/completions", {
            "model": model_name, "max_tokens": 4, "stream": True, "user": NUL, "stop": NUL,
            "messages": [{"role": "user", "content": NUL * 8}]}),
        "cmpl": ("/v1/completions", {"model": model_name, "prompt": f"a{NUL}b", "max_tokens": 4, "user": NUL,
                                     "stop": [NUL]}),
    }
    with httpx.Client(timeout=60) as http:
        for name, (path, body) in sent.items():
            r = http.post(live.base_url + path, headers={**h, "X-Request-Id": f"nul-{name}-{tag}"}, json=body)
            assert r.status_code == 200, (name, r.text)
        after = http.post(live.base_url + "/v1/chat/completions", headers={**h, "X-Request-Id": f"nul-after-{tag}"},
                          json={"model": model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
        assert after.status_code == 200
        # a key name or allowed model with NUL is refused before anything is stored
        writer = live.new_key(tenant="e2e", scopes="keys:write")
        for bad in ({"name": f"k{NUL}"}, {"name": "k", "allowed_models": [f"m{NUL}"]}):
            r = http.post(live.base_url + "/api/v1/keys", headers={"Authorization": f"Bearer {writer}"}, json=bad)
            assert r.status_code == 400, r.text

    ids = {f"{prefix}-nul-{name}-{tag}" for name, prefix in (("chat", "chatcmpl"), ("chat-stream", "chatcmpl"),
                                                             ("cmpl", "cmpl"), ("after", "chatcmpl"))}
    rows = []
    for request_id in sorted(ids):
        (row,) = records(live, request_id, 1, timeout=20)
        assert row["status_code"] == 200 and row["completion_tokens"] > 0, row
        rows.append(row)
    assert len(rows) == 4
    assert live.redis.xlen(f"{live.prefix}:usage:dead") == 0  # nothing was set aside as invalid
