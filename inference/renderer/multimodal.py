"""Multimodal chat input: image parts out of the messages, preprocessing with the model's own
Hugging Face image processor, the shared feature cache, and placeholder expansion.

Flow (the api process runs ``extract_images`` and ``expand_image_tokens``; a Celery ``mm`` worker runs
``preprocess_images``, see ``inference.workers.mm_tasks``):

1. ``extract_images(messages)``: every ``{"type": "image_url", "image_url": {"url": ...}}`` part (also a
   bare string ``image_url``) becomes ``{"type": "image"}`` for the chat template (Qwen-VL templates emit
   ``<|vision_start|><|image_pad|><|vision_end|>`` for it) and is returned as an ``ImageItem`` naming its
   part (``messages[i].content[j]``).
2. ``preprocess_images``: per item, bytes from the ``data:`` URL or a guarded fetch
   (``inference.media.guard``), key = hash(bytes + processor settings), cache hit → its token count; miss
   → decode (``inference.media.image``), run the processor, store the features. A fetched URL's key is
   remembered for ``MM_URL_CACHE_TTL_S`` (default 300 s; keyed by URL and fetch policy), so the same URL
   sent twice is fetched once.
3. ``expand_image_tokens(ids, image_token_id, counts)``: the k-th single image placeholder in the
   rendered prompt becomes ``counts[k]`` copies, so the engine receives exactly as many image tokens as the
   processor produced features for.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, cast

from inference.shared.config import SETTINGS
from inference.media.cache import FeatureCache, ImageFeatures, mm_cache_key
from inference.media.guard import FetchPolicy, fetch_urls
from inference.media.image import ImageError, decode_image, parse_data_url

if TYPE_CHECKING:
    import redis

URL_CACHE_TTL_S = SETTINGS.mm_url_cache_ttl_s
MM_BLOB_TTL_S = SETTINGS.mm_blob_ttl_s  # image bytes waiting for an mm worker
MAX_IMAGES_PER_REQUEST = SETTINGS.mm_max_images_per_request


@dataclass
class ImageItem:
    """One image part: ``part`` names it (``messages[0].content[1]``), ``url`` is ``data:`` or http(s)."""

    part: str
    url: str


def extract_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageItem]]:
    """Copy of ``messages`` with image parts replaced by ``{"type": "image"}``, and the image items in
    prompt order. Raises ``ImageError`` for a malformed image part or more than
    ``MAX_IMAGES_PER_REQUEST`` images."""
    out_msgs, items = [], []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if not isinstance(content, list):
            out_msgs.append(msg)
            continue
        new_content = []
        for j, part in enumerate(content):
            name = f"messages[{i}].content[{j}]"
            if isinstance(part, dict) and part.get("type") == "image_url":
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, dict) else spec
                if not isinstance(url, str) or not url:
                    raise ImageError(f"{name}: image_url.url must be a non-empty string", name)
                items.append(ImageItem(part=name, url=url))
                new_content.append({"type": "image"})
            else:
                new_content.append(part)
        out_msgs.append({**msg, "content": new_content})
    if len(items) > MAX_IMAGES_PER_REQUEST:
        raise ImageError(f"at most {MAX_IMAGES_PER_REQUEST} images per request", "messages")
    return out_msgs, items


def has_images(messages: list[dict[str, Any]]) -> bool:
    """True when any message has an ``image_url`` content part."""
    return any(isinstance(m.get("content"), list) and any(
        isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"]) for m in messages)


def vision_config(model_dir: str) -> dict[str, int] | None:
    """``{"image_token_id", "merge_size"}`` of a vision-language model directory, or ``None`` when the
    model has no vision tower (``config.json`` without ``vision_config``). Cached per file mtime."""
    path = Path(model_dir) / "config.json"
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return None
    return _vision_config(str(path), mtime)


@functools.lru_cache(maxsize=64)
def _vision_config(path: str, _mtime_ns: int) -> dict[str, int] | None:
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if "vision_config" not in cfg or cfg.get("image_token_id") is None:
        return None
    return {"image_token_id": int(cfg["image_token_id"]),
            "merge_size": int(cfg["vision_config"].get("spatial_merge_size", 2))}


def expand_image_tokens(ids: list[int], image_token_id: int, counts: list[int]) -> list[int]:
    """Replace the k-th ``image_token_id`` of ``ids`` by ``counts[k]`` copies. Raises ``ImageError`` when
    the number of placeholders differs from ``len(counts)`` (a template that drops or repeats images)."""
    out: list[int] = []
    k = 0
    for t in ids:
        if t == image_token_id:
            if k >= len(counts):
                raise ImageError("the chat template produced more image placeholders than images", "messages")
            out.extend([image_token_id] * counts[k])
            k += 1
        else:
            out.append(t)
    if k != len(counts):
        raise ImageError(f"the chat template placed {k} image placeholder(s) for {len(counts)} image(s)",
                         "messages")
    return out


_proc_lock = threading.Lock()
_processors: dict[str, Any] = {}


def get_image_processor(model_dir: str) -> Any:
    """The model's own HF image processor (``AutoImageProcessor``, local directory only), once per process (Any:
    transformers leaves its loaders and processors unannotated)."""
    with _proc_lock:
        proc = _processors.get(model_dir)
        if proc is None:
            from transformers import AutoImageProcessor

            load = cast(Callable[..., Any], AutoImageProcessor.from_pretrained)  # unannotated
            proc = load(model_dir, local_files_only=True)
            _processors[model_dir] = proc
        return proc


PROCESSOR_CONFIG_FILES = ("preprocessor_config.json", "processor_config.json")
_settings_lock = threading.Lock()
_Stamp = tuple[tuple[str, int | None, int | None], ...]  # (file name, size, mtime ns) per config file
_settings: dict[str, tuple[_Stamp, dict[str, Any]]] = {}


def processor_settings(model_dir: str) -> dict[str, Any]:
    """What the processed features depend on, without loading the processor: the SHA-256 of each of the
    model directory's processor configuration files (``PROCESSOR_CONFIG_FILES``) and the ``transformers``
    version. The api process (cache hits, see ``data_url_cache_entry``) and the ``mm`` workers compute the
    same value; an edited config file changes it at once (cached per file size and mtime)."""
    from importlib.metadata import version

    stamp: list[tuple[str, int | None, int | None]] = []
    for name in PROCESSOR_CONFIG_FILES:
        try:
            st = (Path(model_dir) / name).stat()
            stamp.append((name, st.st_size, st.st_mtime_ns))
        except OSError:
            stamp.append((name, None, None))
    stamp_t = tuple(stamp)
    with _settings_lock:
        hit = _settings.get(model_dir)
        if hit is not None and hit[0] == stamp_t:
            return hit[1]
    files = {}
    for name, size, _mtime in stamp_t:
        if size is not None:
            files[name] = hashlib.sha256((Path(model_dir) / name).read_bytes()).hexdigest()
    settings = {"files": files, "transformers": version("transformers")}
    with _settings_lock:
        _settings[model_dir] = (stamp_t, settings)
    return settings


def data_url_cache_entry(model_dir: str, url: str, part: str, max_bytes: int | None = None,
                         cache_salt: str | None = None) -> tuple[str, bytes]:
    """``(feature-cache key, image bytes)`` of a ``data:`` URL image (base64 decode + SHA-256; no pixel
    decoding), so the api process can find a cache hit without sending the image to an ``mm`` worker.
    ``cache_salt``: the caller's cache salt (``mm_cache_key``).
    Raises ``ImageError`` (400) for a malformed or oversized ``data:`` URL, with the message the worker
    would give."""
    limit = int(max_bytes or FetchPolicy.max_bytes)
    data = parse_data_url(url, part, limit)
    return mm_cache_key(data, processor_settings(model_dir), cache_salt), data


def mm_blob_key(prefix: str, key: str) -> str:
    """Redis key under which the api process hands an image's bytes to an ``mm`` worker."""
    return f"{prefix}:mm:blob:{key}"


def process_image(model_dir: str, data: bytes, part: str) -> ImageFeatures:
    """Decode ``data`` and run the model's image processor. Raises ``ImageError`` naming ``part``."""
    img = decode_image(data, part)
    proc = get_image_processor(model_dir)
    try:
        out = proc(images=[img], return_tensors="np")
    except (ValueError, TypeError) as exc:
        raise ImageError(f"{part}: the image processor refused the image ({exc})", part) from None
    grid = [int(x) for x in out["image_grid_thw"][0]]
    merge = int(getattr(proc, "merge_size", 2) or 2)
    return ImageFeatures(pixel_values=out["pixel_values"], grid_thw=grid,
                         num_tokens=grid[0] * grid[1] * grid[2] // (merge * merge))


def _url_cache_key(prefix: str, url: str, policy: FetchPolicy, settings_hash: str, cache_salt: str | None) -> str:
    h = hashlib.sha256(json.dumps([url, [str(n) for n in policy.allow_nets], policy.allowed_domains,
                                   settings_hash, cache_salt or ""]).encode()).hexdigest()
    return f"{prefix}:mm:url:{h}"


def preprocess_images(redis_client: redis.Redis, prefix: str, model_dir: str, urls: list[dict[str, str]],
                      allowed_domains: list[str] | None = None, max_bytes: int | None = None,
                      cache_salt: str | None = None) -> list[dict[str, Any]]:
    """Preprocess the images of one request (blocking; runs on an ``mm`` worker).

    ``urls``: in prompt order, ``{"part": str, "url": str}`` or ``{"part", "key", "blob"}`` (bytes the api
    process stored under Redis key ``blob``, their feature-cache key already computed; the blob is deleted
    once used). ``cache_salt``: the caller's cache salt, part of every key computed here (``mm_cache_key``) and of
    the remembered-URL key, so one tenant's fetches and features are never another's hits.
    Returns ``[{"key": str, "num_tokens": int,
    "cached": bool}]``. Processor runs are counted in ``{prefix}:mm:processor_calls``. Raises ``ImageError``
    (400) for the first bad item. The http(s) URLs not in the URL cache are fetched first, concurrently, under one
    deadline (``inference.media.guard.fetch_urls``); decoding and processing then run in prompt order.
    """
    cache = FeatureCache(redis_client, prefix)
    settings = processor_settings(model_dir)
    settings_hash = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
    policy = FetchPolicy(allowed_domains=list(allowed_domains or []))
    if max_bytes:
        policy.max_bytes = int(max_bytes)
    url_keys = {i: _url_cache_key(prefix, it["url"], policy, settings_hash, cache_salt) for i, it in enumerate(urls)
                 if not it.get("blob") and it["url"].split(":", 1)[0].lower() in ("http", "https")}
    # a bytes-mode client: replies are bytes (redis-py's types cover decoded clients too)
    replies = cast("list[bytes | None]", redis_client.mget(list(url_keys.values()))) if url_keys else []
    cached_urls = dict(zip(url_keys, replies))
    to_fetch = [i for i in url_keys if (hit := cached_urls[i]) is None or cache.get_meta(hit.decode()) is None]
    fetched = dict(zip(to_fetch, fetch_urls([(urls[i]["url"], urls[i]["part"]) for i in to_fetch], policy)))
    results = []
    for index, item in enumerate(urls):
        part = item["part"]
        if item.get("blob"):
            key = str(item["key"])
            meta = cache.get_meta(key)  # processed meanwhile by a concurrent request
            if meta is None:
                data = cast("bytes | None", redis_client.get(item["blob"]))
                if data is None:
                    raise ImageError(f"{part}: the image expired before a preprocessing worker was free; retry",
                                     part, "image_expired")
                feats = process_image(model_dir, data, part)
                redis_client.incr(f"{prefix}:mm:processor_calls")
                cache.put(key, feats)
            redis_client.delete(item["blob"])
            results.append({"key": key, "num_tokens": meta["num_tokens"] if meta else feats.num_tokens,
                            "cached": meta is not None})
            continue
        url = item["url"]
        url_key = url_keys.get(index)
        if url_key is not None and index not in fetched and (hit := cached_urls[index]) is not None:
            meta = cache.get_meta(hit.decode())  # looked up above: a hit, unless it expired since
            if meta is not None:
                results.append({"key": hit.decode(), "num_tokens": meta["num_tokens"], "cached": True})
                continue
        if url.startswith("data:"):
            data = parse_data_url(url, part, policy.max_bytes)
        elif url.split(":", 1)[0].lower() in ("http", "https"):
            # fetched above; or, had its URL cache entry expired since, now
            got = fetched[index] if index in fetched else fetch_urls([(url, part)], policy)[0]
            if isinstance(got, ImageError):
                raise got
            data = got
        else:
            raise ImageError(f"{part}: image URLs must be data:, http: or https:", part, "image_url_blocked")
        key = mm_cache_key(data, settings, cache_salt)
        meta = cache.get_meta(key)
        if meta is not None:
            results.append({"key": key, "num_tokens": meta["num_tokens"], "cached": True})
        else:
            feats = process_image(model_dir, data, part)
            redis_client.incr(f"{prefix}:mm:processor_calls")
            cache.put(key, feats)
            results.append({"key": key, "num_tokens": feats.num_tokens, "cached": False})
        if url_key is not None:
            redis_client.set(url_key, key, ex=URL_CACHE_TTL_S)
    return results
