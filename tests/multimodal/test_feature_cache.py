"""The shared feature cache and its keys (real Redis): the api process's key equals the worker's, processor
settings come from the config files, eviction keeps the metadata hash in step with the features."""

from __future__ import annotations

import os
import shutil
import uuid

import numpy as np
import pytest
import redis

from inference.media.cache import FeatureCache, ImageFeatures, feature_meta_key, mm_cache_key
from inference.media.image import ImageError
from inference.renderer.multimodal import data_url_cache_entry, processor_settings
from harness.assets import ensure_vl_model
from harness.images import data_url, image_bytes


@pytest.fixture
def cache():
    client = redis.Redis.from_url(os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/4")
    prefix = f"fctest-{uuid.uuid4().hex[:8]}"
    yield client, prefix
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def _feats(n: int, tokens: int) -> ImageFeatures:
    return ImageFeatures(pixel_values=np.full((n, 8), 0.5, dtype=np.float32), grid_thw=[1, 2, n // 2],
                         num_tokens=tokens)


def test_data_url_key_matches_the_workers_key_and_follows_the_config_files(tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(ensure_vl_model(), model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    raw = image_bytes(seed=3)
    key, data = data_url_cache_entry(str(model_dir), data_url(raw), "messages[0].content[0]")
    assert data == raw
    assert key == mm_cache_key(raw, processor_settings(str(model_dir)))  # what the mm worker computes
    assert key != data_url_cache_entry(str(model_dir), data_url(image_bytes(seed=4)), "p")[0]
    config = model_dir / "preprocessor_config.json"
    config.write_text(config.read_text().replace('"merge_size": 2', '"merge_size": 2 '))
    assert data_url_cache_entry(str(model_dir), data_url(raw), "p")[0] != key  # edited settings: new key
    with pytest.raises(ImageError, match="larger than"):
        data_url_cache_entry(str(model_dir), data_url(raw), "p", max_bytes=16)
    with pytest.raises(ImageError, match="base64"):
        data_url_cache_entry(str(model_dir), "data:image/png;base64,@@@", "p")


def test_meta_hash_follows_put_and_eviction(cache):
    client, prefix = cache
    fc = FeatureCache(client, prefix, max_bytes=3 * len(_feats(64, 16).to_bytes()) + 10)
    for i in range(3):
        fc.put(f"k{i}", _feats(64, 16 + i))
    assert fc.get_meta("k1") == {"num_tokens": 17, "grid_thw": [1, 2, 32]}  # k1 now more recent than k2
    fc.get("k0")  # and k0 more recent than k1
    fc.put("k3", _feats(64, 19))  # over the bound: the least recently used (k2) goes, with its metadata
    assert fc.get_meta("k2") is None and client.hget(feature_meta_key(prefix), "k2") is None
    assert fc.get("k2") is None
    assert {fc.get_meta(k)["num_tokens"] for k in ("k0", "k1", "k3")} == {16, 17, 19}
    assert client.hlen(feature_meta_key(prefix)) == 3


def test_worker_takes_image_bytes_from_a_blob_once(cache):
    from inference.renderer.multimodal import data_url_cache_entry, mm_blob_key, preprocess_images

    client, prefix = cache
    model_dir = str(ensure_vl_model())
    key, raw = data_url_cache_entry(model_dir, data_url(image_bytes(seed=21)), "messages[0].content[0]")
    blob = mm_blob_key(prefix, key)
    client.set(blob, raw, ex=60)
    item = {"part": "messages[0].content[0]", "key": key, "blob": blob}
    [first] = preprocess_images(client, prefix, model_dir, [item])
    assert first["key"] == key and not first["cached"] and first["num_tokens"] == 6
    assert client.get(blob) is None  # used once, then deleted
    [again] = preprocess_images(client, prefix, model_dir, [item])  # processed meanwhile: no blob needed
    assert again == {**first, "cached": True}
    assert int(client.get(f"{prefix}:mm:processor_calls")) == 1
    other_key = mm_cache_key(b"never stored", processor_settings(model_dir))
    with pytest.raises(ImageError) as info:
        preprocess_images(client, prefix, model_dir, [{"part": "p", "key": other_key, "blob": mm_blob_key(prefix, "x")}])
    assert info.value.code == "image_expired"
