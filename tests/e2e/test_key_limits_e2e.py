"""Per-key limits through the gateway: 429 with Retry-After and x-ratelimit-* headers, streaming included."""

from __future__ import annotations

import httpx

from tests.support.live import limited_key


def chat(live, key, model_name, **extra):
    return httpx.post(live.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                            **extra}, timeout=60)


def test_rpm_limit_429_with_headers(live, model_name):
    key = limited_key(live, rpm_limit=2)
    first = chat(live, key, model_name)
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert "x-ratelimit-reset-requests" in first.headers
    assert chat(live, key, model_name).status_code == 200
    refused = chat(live, key, model_name)
    assert refused.status_code == 429, refused.text
    err = refused.json()["error"]
    assert err["type"] == "rate_limit_error" and err["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    # another key of the same platform is not affected: 429 is about this key only
    assert chat(live, live.api_key, model_name).status_code == 200


def test_streaming_response_carries_rate_limit_headers(live, model_name):
    key = limited_key(live, rpm_limit=50, tpm_limit=100000)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", live.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"model": model_name, "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 2, "stream": True}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            assert resp.headers["x-ratelimit-limit-requests"] == "50"
            assert resp.headers["x-ratelimit-limit-tokens"] == "100000"
            assert int(resp.headers["x-ratelimit-remaining-tokens"]) < 100000
            body = resp.read().decode()
    assert body.rstrip().endswith("data: [DONE]")


def test_concurrency_limit_counts_in_flight_requests(live, model_name):
    import concurrent.futures

    key = limited_key(live, max_concurrent_requests=1)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: chat(live, key, model_name, max_tokens=60, ignore_eos=True).status_code,
                              range(4)))
    assert codes.count(200) >= 1 and codes.count(429) >= 1 and set(codes) <= {200, 429}
    assert chat(live, key, model_name).status_code == 200  # the slot was given back
