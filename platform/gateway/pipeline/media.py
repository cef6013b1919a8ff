"""Step 7 (docs/ARCHITECTURE.md §2, §4): images in chat requests, gateway side. ``data:`` images already in the shared
feature cache are found here by content hash and skip the ``mm`` queue; the template render (queue ``render``) and the
preprocessing of the others (queue ``mm``) run concurrently, then the prompt's image placeholders are expanded to the
exact token counts and the engine requests get the feature-cache keys.

Per-model media domain allowlists come from ``settings.MM_ALLOWED_MEDIA_DOMAINS`` (JSON object
``{"served_model_name": ["example.com", "*.cdn.example"]}``), applied by the fetcher to every redirect hop;
operator network allowlist: ``MM_FETCH_ALLOW_NETS`` (read by the ``mm`` workers, see
``inference.media.guard``).

Image work per tenant is bounded: a tenant may have at most ``MM_TENANT_MAX_CONCURRENT`` (default 2)
``mm`` tasks queued or running at once, across every api process (a Redis sorted set of leases per tenant, each
lease expiring ``MM_WAIT_TIMEOUT_S`` + 10 s after it was taken, so a dead api process's slot comes back by
itself). One more is refused at once with 429 (``rate_limit_error``, code ``image_concurrency_exceeded``,
``Retry-After``), before its task is published. With the worker fetching a request's URLs concurrently under one
deadline (``MM_FETCH_TIMEOUT_S``), a tenant can hold the image workers for at most about K × that deadline
before another tenant's task runs, however many slow URLs or requests it sends.
"""

from __future__ import annotations

import asyncio
import secrets
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, cast

from django.conf import settings

from config.celery import app as celery_app
from gateway.errors import ApiError, ErrorCode, ErrorType, bad_request
from registry.backends import IMAGES
from gateway.model_cache import ModelSnapshot
from gateway.clients import redis
from gateway.pipeline.failures import api_error_from
from gateway.pipeline.rendering import call_render
from inference.media.cache import feature_meta_decode, feature_meta_key
from inference.media.image import ImageError
from inference.protocol.render import ChatRenderRequest, ImageFeatures, ImagesRequest, ImageWorkItem, RenderFailure
from inference.api.render_client import RenderReplyWaiter, RenderUnavailableError
from inference.renderer.multimodal import (
    MM_BLOB_TTL_S,
    ImageItem,
    data_url_cache_entry,
    expand_image_tokens,
    extract_images,
    has_images,
    mm_blob_key,
    vision_config,
)

# KEYS[1] the tenant's lease set. ARGV: lease id, limit, lease ms. Returns 1 (taken) or 0 (full).
_MM_SLOT_LUA = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) * 2)
return 1
"""


def mm_tenant_key(prefix: str, tenant_id: int) -> str:
    """Redis sorted set of a tenant's ``mm`` task leases (member: lease id, score: expiry in ms)."""
    return f"{prefix}:mm:tenant:{tenant_id}"


@asynccontextmanager
async def mm_tenant_slot(tenant_id: int | None) -> AsyncIterator[None]:
    """Hold one of ``tenant_id``'s ``MM_TENANT_MAX_CONCURRENT`` image-work slots (module docstring) while the
    body runs; released on every exit. ``tenant_id`` None or a limit of 0: no bound. Raises ``ApiError`` 429 when
    the tenant already holds them all."""
    limit = settings.MM_TENANT_MAX_CONCURRENT
    if tenant_id is None or limit <= 0:
        yield
        return
    pool = redis()
    key, lease = mm_tenant_key(settings.LINK_PREFIX, tenant_id), secrets.token_hex(8)
    taken = await pool.eval(_MM_SLOT_LUA, 1, key, lease, limit, int((settings.MM_WAIT_TIMEOUT_S + 10) * 1000))
    if not int(taken):
        raise ApiError(429, f"Too many image requests in progress for this tenant: at most {limit} at once. "
                       "Retry after 1 s.", ErrorType.RATE_LIMIT, "messages", ErrorCode.IMAGE_CONCURRENCY_EXCEEDED,
                       [("retry-after", "1")])
    try:
        yield
    finally:
        try:
            await asyncio.shield(pool.zrem(key, lease))
        except Exception:  # noqa: BLE001 - the lease expires by itself
            pass


def allowed_domains_for(model_name: str) -> list[str]:
    """The per-model media domain allowlist (empty = any public host)."""
    value = settings.MM_ALLOWED_MEDIA_DOMAINS.get(model_name) or []
    return [str(v) for v in value] if isinstance(value, list) else []


async def call_mm(model: ModelSnapshot, items: list[ImageWorkItem], cache_salt: str,
                  tenant_id: int | None = None) -> list[ImageFeatures]:
    """Preprocess ``items`` on the ``mm`` queue (an ``ImagesRequest``), keyed under ``cache_salt``, in one of
    ``tenant_id``'s image-work slots (``mm_tenant_slot``); returns their ``ImageFeatures`` in order. The worker's
    ``RenderFailure`` and no answer are mapped by ``failures.api_error_from``: client errors → 400 naming the part;
    no worker in time → 503; worker bug → 500. Tenant over its slots → 429."""
    request = ImagesRequest(prefix=settings.LINK_PREFIX, model_dir=model.model_dir, items=items,
                            allowed_domains=allowed_domains_for(model.served_model_name), cache_salt=cache_salt)
    waiter = RenderReplyWaiter.for_current_loop(settings.REDIS_URL, settings.LINK_PREFIX)
    try:
        async with mm_tenant_slot(tenant_id):
            reply = await waiter.request(celery_app, request, timeout=settings.MM_WAIT_TIMEOUT_S)
    except RenderUnavailableError as exc:
        raise api_error_from(exc) from None
    if isinstance(reply, RenderFailure):
        raise api_error_from(reply) from None
    return reply.items


async def cached_images(model: ModelSnapshot, items: list[ImageItem], cache_salt: str,
                        ) -> tuple[list[ImageFeatures | None], list[ImageWorkItem]]:
    """Look up the ``data:`` URL images of ``items`` in the shared feature cache, under the caller's
    ``cache_salt`` (``inputs.cache_salt_for``: another tenant's copy of an image is not a hit).

    Returns ``(hits, work)``: per item its ``ImageFeatures`` (``cached``) for a hit, else ``None``; and, per item
    that is not a hit, the ``mm`` work item: with ``key`` and ``blob`` for a ``data:`` image (its decoded bytes are
    stored under ``blob`` in Redis for ``MM_BLOB_TTL_S``, so the image does not travel inside the Celery message as
    base64 JSON), with ``url`` for an http(s) URL. Keys are computed in a thread (base64 decode + SHA-256), the
    lookup is one ``HMGET`` of the small metadata hash. Raises 400 for a malformed or oversized ``data:`` URL.
    """
    out: list[ImageFeatures | None] = [None] * len(items)
    data_items = [(i, it) for i, it in enumerate(items) if it.url.startswith("data:")]
    decoded: dict[int, tuple[str, bytes]] = {}
    if data_items:
        def keys() -> list[tuple[str, bytes]]:
            return [data_url_cache_entry(model.model_dir, it.url, it.part, cache_salt=cache_salt)
                    for _i, it in data_items]

        try:
            found = await asyncio.to_thread(keys)
        except ImageError as exc:
            raise api_error_from(exc) from None
        metas = await redis().hmget(feature_meta_key(settings.LINK_PREFIX), [key for key, _data in found])
        for (i, _it), (key, data), raw in zip(data_items, found, metas):
            if raw is not None:
                out[i] = ImageFeatures(key, int(feature_meta_decode(cast(bytes, raw))["num_tokens"]), cached=True)
            else:
                decoded[i] = (key, data)
    work: list[ImageWorkItem] = []
    if decoded:
        async with redis().pipeline(transaction=False) as pipe:
            for key, data in decoded.values():
                pipe.set(mm_blob_key(settings.LINK_PREFIX, key), data, ex=MM_BLOB_TTL_S)
            await pipe.execute()
    for i, it in enumerate(items):
        if out[i] is None:
            if i in decoded:
                key = decoded[i][0]
                work.append(ImageWorkItem(it.part, key=key, blob=mm_blob_key(settings.LINK_PREFIX, key)))
            else:
                work.append(ImageWorkItem(it.part, url=it.url))
    return out, work


@dataclass
class RenderedChat:
    """A chat's prompt ready for input processing: its token ids, image placeholders expanded, and the feature-cache
    keys of its images in order (``EngineCoreRequest.mm_cache_keys``; empty without images)."""

    prompt_token_ids: list[int]
    mm_cache_keys: list[str] = field(default_factory=list)


async def render_chat_media(model: ModelSnapshot, request: ChatRenderRequest, *, cache_salt: str,
                            tenant_id: int | None = None) -> RenderedChat:
    """``call_render(request)``, plus images when the messages have any: the prompt's ids with the image
    placeholders expanded and the images' feature-cache keys; the feature-cache keys and the render's segment-cache
    keys salted with ``cache_salt`` (``inputs.cache_salt_for``). ``tenant_id``: whose image-work slot the ``mm`` task
    takes (``mm_tenant_slot``; None: unbounded)."""
    request = replace(request, cache_salt=cache_salt)  # the render's segment cache is scoped as the prefix cache is
    if not has_images(request.messages):
        return RenderedChat((await call_render(request)).prompt_token_ids)
    vc = vision_config(model.model_dir)
    if vc is None:
        raise bad_request(f"The model '{model.served_model_name}' does not accept images", "messages",
                          ErrorCode.IMAGES_NOT_SUPPORTED)
    if IMAGES in model.unsupported_features:
        raise bad_request(f"The model '{model.served_model_name}' is served by an engine backend that does not take "
                          "image inputs", "messages", ErrorCode.IMAGES_NOT_SUPPORTED)
    try:
        messages, items = extract_images(request.messages)
    except ImageError as exc:
        raise api_error_from(exc) from None
    mm_items, work = await cached_images(model, items, cache_salt)
    missing = [i for i, hit in enumerate(mm_items) if hit is None]

    async def preprocess_missing() -> list[ImageFeatures]:
        return await call_mm(model, work, cache_salt, tenant_id) if work else []

    rendered, fresh = await asyncio.gather(call_render(replace(request, messages=messages)), preprocess_missing())
    for i, item in zip(missing, fresh):
        mm_items[i] = item
    done = [it for it in mm_items if it is not None]
    if len(done) != len(mm_items):
        raise RuntimeError("the mm worker answered fewer items than it was given")
    try:
        ids = expand_image_tokens(rendered.prompt_token_ids, vc["image_token_id"], [it.num_tokens for it in done])
    except ImageError as exc:
        raise api_error_from(exc) from None
    return RenderedChat(ids, [it.key for it in done])
