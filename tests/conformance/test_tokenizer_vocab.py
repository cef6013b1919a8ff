"""A model served with a tokenizer smaller than its embedding (the demo model's 151,680 rows with Llama 3's
128,256-id tokenizer) must never emit an id its tokenizer cannot decode (seen as a 500 before the fix)."""

from __future__ import annotations

from tests.conformance.conftest import LLAMA_MODEL

LLAMA3_VOCAB = 128_256


def test_sampled_ids_stay_inside_the_served_tokenizer(http):
    for seed in range(4):
        resp = http.post("/v1/completions", json={
            "model": LLAMA_MODEL, "prompt": "Once upon a time", "max_tokens": 64, "temperature": 1.5,
            "seed": seed, "ignore_eos": True, "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        ids = resp.json()["choices"][0]["token_ids"]
        assert len(ids) == 64 and max(ids) < LLAMA3_VOCAB
