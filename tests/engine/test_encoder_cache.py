"""The engine's vision-encoder cache: LRU by bytes, and a cached image gives the same logits as its pixels."""

from __future__ import annotations

import numpy as np
import torch

from inference.engine.encoder_cache import EncodedImage, EncoderCache


def _img(n: int) -> EncodedImage:
    return EncodedImage(embeds=torch.zeros((n, 4), dtype=torch.float32), grid_thw=[1, 2, n * 2])


def test_lru_by_bytes():
    cache = EncoderCache(max_bytes=3 * 16 * 8)  # three entries of 8 x 4 float32
    for k in "abc":
        cache.put(k, _img(8))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("d", _img(8))
    assert "b" not in cache and {"a", "c", "d"} <= {k for k in "abcd" if k in cache}
    assert cache.total_bytes == 3 * 128 and len(cache) == 3
    cache.put("huge", _img(1000))  # larger than the bound: not kept, nothing evicted for it
    assert "huge" not in cache and len(cache) == 3
    cache.put("c", _img(4))  # replacing an entry updates the byte count
    assert cache.total_bytes == 2 * 128 + 64
    assert (cache.hits, cache.get("zz"), cache.misses) == (1, None, 1)


def test_cached_image_gives_the_same_logits_as_its_pixels(redis_url):
    import random
    import uuid

    import redis

    from inference.engine.sequence import Sequence
    from inference.engine.vl_runner import VLModelRunner
    from inference.media.cache import FeatureCache
    from inference.protocol.engine import EngineCoreRequest, SamplingParams
    from inference.renderer.multimodal import process_image
    from harness.assets import ensure_vl_model
    from harness.images import image_bytes

    model_dir = str(ensure_vl_model())
    prefix = f"enctest-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    try:
        runner = VLModelRunner(model_dir, max_model_len=1024, redis_url=redis_url, link_prefix=prefix)
        feats = process_image(model_dir, image_bytes(size=(120, 90), seed=5), "p")
        FeatureCache(client, prefix).put("img1", feats)
        ids = [151644, 872, 198, 151652] + [runner.image_token_id] * feats.num_tokens + [151653, 151645]

        def run() -> torch.Tensor:
            rid = f"r-{uuid.uuid4().hex[:6]}"
            req = EngineCoreRequest(request_id=rid, external_req_id=rid, prompt_token_ids=list(ids),
                                    sampling_params=SamplingParams(max_tokens=2), client_id="c", arrival_time=0.0,
                                    mm_cache_keys=["img1"])
            seq = Sequence(request=req, queued_ts=0.0, rng=random.Random(0))
            runner.prepare(seq)
            logits = runner.prefill([seq])
            runner.reset()
            return logits

        first = run()
        assert "img1" in runner.encoder_cache and runner.encoder_cache.hits == 0
        client.delete(f"{prefix}:mm:feat:img1")  # the second run must not need the pixels any more
        second = run()
        assert runner.encoder_cache.hits == 1
        np.testing.assert_allclose(second.numpy(), first.numpy(), rtol=0, atol=1e-5)
    finally:
        for key in client.scan_iter(match=f"{prefix}:*"):
            client.delete(key)
        client.close()
