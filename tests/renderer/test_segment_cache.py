"""Segment-level tokenization cache (``inference.renderer.segment_cache``): ids assembled from cached segments
equal the tokenizer's own encoding of the whole text, on the six real tokenizers.

* every conversation of the template conformance corpus, rendered by its real template, cut at every boundary
  and through the cache (first a miss, then a hit) equals ``tokenizers``' whole-prompt ids, with and without
  the post-processor's BOS/EOS;
* a hypothesis property: random texts of unicode, whitespace runs and the tokenizer's own added tokens
  (special and not, BOS/EOS included) embedded anywhere;
* the control-token path (``encode_with_trusted``) gives the same ids with the cache as without;
* a tokenizer where the split property fails (Llama-2 files with ``legacy: false``: Metaspace
  ``prepend_scheme="first"``) is detected at load and encoded whole;
* the LRU is bounded and counts hits and misses;
* the shared tier in Redis: a second worker reads another's long segments with the same ids, short ones stay local,
  and a missing scope, a malformed entry or a dead Redis only make misses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.backoff import NoBackoff
from redis.retry import Retry

from inference.renderer.chat_template import render_chat, render_chat_text
from inference.renderer.errors import RenderError
from inference.renderer.segment_cache import (
    CACHE,
    STATS,
    SegmentLRU,
    build_splitter,
    cached_encode,
    cached_encode_many,
    disable_shared_tier,
    enable_shared_tier,
    shared_scope,
    salt_scope,
    take_shared_writes,
)
from inference.renderer.tokenizer_cache import get_tokenizer, load_tokenizer
from tests.frontend.test_template_conformance import CORPUS
from tests.renderer.tokdirs import NAMES, tok_dir


def whole(name: str, text: str, specials: bool) -> list[int]:
    return get_tokenizer(tok_dir(name)).tokenizer.encode(text, add_special_tokens=specials).ids


@pytest.mark.parametrize("name", NAMES)
def test_every_reference_tokenizer_passes_the_load_self_check(name):
    tok = get_tokenizer(tok_dir(name))
    assert tok.segments is not None and tok.segments.ok, tok.segments and tok.segments.reason
    assert tok.segment_cache_on()


@pytest.mark.parametrize("name", NAMES)
def test_rendered_corpus_through_the_cache_equals_whole_encoding(name):
    tok = get_tokenizer(tok_dir(name))
    assert tok.segments is not None
    template = tok.chat_template or get_tokenizer(tok_dir("qwen3")).chat_template  # gpt-oss/llama2: none shipped
    cache = SegmentLRU(1 << 20)
    rendered = 0
    for _case, body in CORPUS:
        try:
            text = render_chat_text(tok_dir(name), body["messages"], tools=body.get("tools"),
                                    documents=body.get("documents"), chat_template=template,
                                    chat_template_kwargs=body.get("chat_template_kwargs"))
        except RenderError:
            continue  # the template refuses this conversation (e.g. Gemma's role alternation)
        rendered += 1
        for specials in (False, True):
            expected = whole(name, text, specials)
            assert tok.segments.encode(tok.tokenizer, text, specials, min_chars=0, cache=SegmentLRU(0)) == expected
            for _ in range(2):  # a miss, then a hit
                assert tok.segments.encode(tok.tokenizer, text, specials, min_chars=8, cache=cache) == expected
    assert rendered >= 20
    assert len(cache) > 0


@pytest.mark.parametrize("name", NAMES)
def test_multi_turn_prompts_hit_the_cache_for_their_history(name):
    tok = get_tokenizer(tok_dir(name))
    if tok.chat_template is None:
        pytest.skip("no chat template")
    messages = [{"role": "system", "content": "You are a careful assistant. " * 4}]
    hits_before = STATS.hits
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question {turn}: what about the tides? " * 5})
        out = render_chat(tok_dir(name), messages)
        assert out.prompt_token_ids == whole(name, out.prompt_text, False)
        messages.append({"role": "assistant", "content": f"Answer {turn}: they rise and fall twice a day. " * 5})
    assert STATS.hits - hits_before >= 3  # the history's segments came from the cache on later turns


def _pieces(name: str) -> st.SearchStrategy[str]:
    tok = get_tokenizer(tok_dir(name))
    added = sorted(t.content for t in tok.tokenizer.get_added_tokens_decoder().values())
    named = [s for s in (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) if s]
    ws = st.text(alphabet=" \t\n\r\u00a0\u3000\u2581", min_size=1, max_size=6)
    uni = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24)
    words = st.sampled_from(["Hello", " world", "the", " 123", "4567", "'s", "ça", "日本", "🙂", "e\u0301", "\u2581x"])
    return st.one_of(uni, ws, words, st.sampled_from(added[:64] + added[-64:] + named))


@pytest.mark.parametrize("name", NAMES)
def test_property_random_texts_with_embedded_added_tokens(name):
    tok = get_tokenizer(tok_dir(name))
    assert tok.segments is not None

    @settings(max_examples=120, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(_pieces(name), max_size=12).map("".join), st.booleans())
    def check(text: str, specials: bool) -> None:
        expected = whole(name, text, specials)
        assert tok.segments.encode(tok.tokenizer, text, specials, min_chars=0, cache=SegmentLRU(0)) == expected
        cache = SegmentLRU(1 << 16)
        assert tok.segments.encode(tok.tokenizer, text, specials, min_chars=1, cache=cache) == expected
        assert tok.segments.encode(tok.tokenizer, text, specials, min_chars=1, cache=cache) == expected
        assert tok.encode(text, specials) == expected

    check()


@pytest.mark.parametrize("name", NAMES)
def test_trusted_spans_path_is_the_same_with_and_without_the_cache(name):
    tok = get_tokenizer(tok_dir(name))
    if tok.control_regex is None:
        pytest.skip("no control tokens")
    control = tok.control_tokens[0]
    body = "A long user turn that mentions " + control + " as text, and more text after it. " * 3
    text = control + body + control + body * 2 + control
    trusted = [(0, len(control)), (len(control) + len(body), 2 * len(control) + len(body)),
               (len(text) - len(control), len(text))]
    for specials in (False, True):
        with_cache = [tok.encode_with_trusted(text, trusted, specials) for _ in range(2)]
        tok_off = dataclasses.replace(tok, segments=None)  # the uncached path (Encoding.merge + post_process)
        assert not tok_off.segment_cache_on()
        without = tok_off.encode_with_trusted(text, trusted, specials)
        assert with_cache[0] == with_cache[1] == without


def test_tokenizer_without_the_split_property_is_detected_and_encoded_whole(tmp_path: Path):
    """Llama-2 files with ``legacy: false``: transformers' rebuild uses Metaspace ``prepend_scheme="first"``, so the
    text after an added token gets no ``▁`` inside a prompt but would get one when encoded alone."""
    src = Path(tok_dir("llama2"))
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["legacy"] = False
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(str(tmp_path))
    assert tok.segments is not None and not tok.segments.ok
    assert "self-check" in tok.segments.reason
    assert not tok.segment_cache_on()
    text = ("<s>[INST] " + "Tell me about the sea. " * 10 + "[/INST]</s>") * 3
    assert tok.encode(text, False) == tok.tokenizer.encode(text, add_special_tokens=False).ids
    # and the cut encoding would indeed have differed: the refusal is needed, not a formality
    forced = build_splitter(tok.tokenizer, "forced")
    assert not forced.ok


def counting_encoder() -> tuple[list[str], Callable[[str], list[int]]]:
    """``(calls, encode)``: an encoder of each character's code point that records every text it is given."""
    calls: list[str] = []

    def enc(s: str) -> list[int]:
        calls.append(s)
        return [ord(c) for c in s]

    return calls, enc


def test_lru_is_bounded_by_tokens_and_counts_hits_and_misses():
    cache = SegmentLRU(10)
    calls, enc = counting_encoder()

    h0, m0 = STATS.hits, STATS.misses
    assert cached_encode(enc, "fp", "full", "abcd", cache) == [97, 98, 99, 100]
    assert cached_encode(enc, "fp", "full", "abcd", cache) == [97, 98, 99, 100]
    assert calls == ["abcd"]
    assert (STATS.hits - h0, STATS.misses - m0) == (1, 1)
    cached_encode(enc, "other-tokenizer", "full", "abcd", cache)  # another tokenizer never reads this entry
    assert len(calls) == 2
    cached_encode(enc, "fp", "full", "efghij", cache)  # 4 + 4 + 6 > 10: the least recent goes
    assert cache.tokens <= 10
    cached_encode(enc, "fp", "full", "x" * 11, cache)  # larger than the bound: not stored
    assert cache.tokens <= 10 and all(len(v) <= 10 for v in cache._data.values())
    off = SegmentLRU(0)
    cached_encode(enc, "fp", "full", "abcd", off)
    assert len(off) == 0 and (STATS.hits - h0, STATS.misses - m0) == (1, 4)  # a disabled cache is not counted
    calls.clear()  # a text repeated within one prompt is encoded once, the second occurrence a hit
    h0, m0 = STATS.hits, STATS.misses
    assert cached_encode_many(enc, "fp", "full", ["wxyz", "wxyz"], cache) == [[119, 120, 121, 122]] * 2
    assert calls == ["wxyz"] and (STATS.hits - h0, STATS.misses - m0) == (1, 1)


# -- the shared tier in Redis (D-303) ---------------------------------------------------------------------------------

@pytest.fixture
def shared_tier():
    """The shared tier on the test Redis under a namespace of this test's own, the local cache and this thread's
    scopes emptied before and after; yields ``(tier, namespace, client)``. Keys under the namespace are deleted
    afterwards."""
    from tests.support.redis import TEST_REDIS_URL, redis_or_skip
    from harness.redis_keys import delete_prefix

    if CACHE.max_tokens == 0:
        pytest.skip("SEGMENT_CACHE_MAX_TOKENS=0: no segment cache, so no shared tier")
    client = redis_or_skip()
    namespace = f"test-segtier-{uuid.uuid4().hex[:8]}"
    CACHE.clear()
    shared_scope(None)  # nothing left on this thread by an earlier test
    salt_scope(None)
    take_shared_writes()
    tier = enable_shared_tier(lambda: client, min_chars=200, ttl_s=60)
    assert tier is not None
    try:
        yield tier, namespace, client
    finally:
        shared_scope(None)
        salt_scope(None)
        take_shared_writes()
        disable_shared_tier()
        CACHE.clear()
        delete_prefix(TEST_REDIS_URL, namespace)
        client.close()


TENANT_SALT = "a1" * 32  # a cache salt as gateway.pipeline.inputs.cache_salt_for makes them (64 hex characters)


def _conversation(turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You are a careful assistant who knows the sea. " * 8}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: what about the tides and currents? " * 9})
        messages.append({"role": "assistant", "content": f"Answer {turn}: they rise and fall twice a day. " * 9})
    # 64 to 200 characters: cached locally, never in the shared tier (min_chars=200 in these tests)
    messages.append({"role": "user",
                     "content": "And now, one more question about the sea, if you have the time today?"})
    return messages


def _write(client, writes) -> None:
    pipe = client.pipeline(transaction=False)
    for key, value, ttl_s in writes:
        pipe.set(key, value, ex=ttl_s)
    pipe.execute()


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "deepseek_v3"])
def test_a_second_worker_reads_long_segments_from_the_shared_tier_with_the_same_ids(name, shared_tier):
    """Worker A renders a conversation and writes its long segments (as the reply pipeline does); worker B, whose
    local cache is empty, gets every long segment from Redis in one read and the same ids as the whole encoding;
    short segments never go to Redis."""
    tier, namespace, client = shared_tier
    tok = get_tokenizer(tok_dir(name))
    if tok.chat_template is None:
        pytest.skip("no chat template")
    messages = _conversation(3)
    shared_scope(namespace)  # worker A
    salt_scope(TENANT_SALT)
    STATS.reset()
    first = render_chat(tok_dir(name), messages)
    writes = take_shared_writes()
    long_misses = STATS.misses
    assert first.prompt_token_ids == whole(name, first.prompt_text, False)
    assert writes and STATS.shared_hits == 0
    assert all(key.startswith(f"{namespace}:segcache:v1-") and ttl == 60 for key, _v, ttl in writes)
    assert len(writes) < long_misses  # the short segments (< 200 characters) stay local
    _write(client, writes)
    assert 0 < client.ttl(writes[0][0]) <= 60

    CACHE.clear()  # worker B: another process, its local cache empty
    shared_scope(namespace)
    salt_scope(TENANT_SALT)
    STATS.reset()
    second = render_chat(tok_dir(name), messages)
    assert second.prompt_token_ids == first.prompt_token_ids
    assert STATS.shared_hits == len(writes) and STATS.hits == len(writes)
    assert take_shared_writes() == []  # nothing new to write


def test_shared_tier_is_skipped_without_a_scope_and_survives_a_dead_or_bad_redis(shared_tier, caplog):
    """No namespace or no cache salt: no Redis read or write. A malformed entry is a miss. A Redis that refuses the
    connection makes the segments misses at once (no retries, logged) and the tier is skipped for a while after."""
    import redis

    tier, namespace, client = shared_tier
    calls, enc = counting_encoder()

    text = "long segment " * 40
    salt_scope(TENANT_SALT)
    assert cached_encode(enc, "fp", "full", text) == enc(text)  # no namespace
    assert take_shared_writes() == []
    CACHE.clear()
    shared_scope(namespace)
    salt_scope(None)
    assert cached_encode(enc, "fp", "full", text) == enc(text)  # no cache salt: fails closed, local only
    assert take_shared_writes() == []
    CACHE.clear()
    salt_scope(TENANT_SALT)
    cached_encode(enc, "fp", "full", text)
    (key, _value, _ttl), = take_shared_writes()
    client.set(key, b"\x01\x02\x03", ex=60)  # not a whole number of ids
    CACHE.clear()
    STATS.reset()
    assert cached_encode(enc, "fp", "full", text) == enc(text)
    assert (STATS.shared_hits, STATS.misses) == (0, 1)
    assert [k for k, _v, _t in take_shared_writes()] == [key]

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    made: list[redis.Redis] = []

    def dead() -> redis.Redis:
        made.append(redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.25, socket_timeout=0.25,
                                retry=Retry(NoBackoff(), 0)))
        return made[-1]

    enable_shared_tier(dead, min_chars=200, ttl_s=60)
    CACHE.clear()
    STATS.reset()
    started = time.monotonic()
    with caplog.at_level("WARNING"):
        assert cached_encode(enc, "fp", "full", text) == enc(text)
    assert time.monotonic() - started < 2.0
    assert STATS.misses == 1 and "shared tier could not be read" in caplog.text
    CACHE.clear()
    assert cached_encode(enc, "fp", "full", text) == enc(text)
    assert len(made) == 1  # backing off: the second lookup did not try Redis again


def test_segments_are_shared_only_within_one_cache_scope(shared_tier):
    """Keys are salted with the request's cache scope (the tenant's, as the prefix cache's are): another scope finds
    nothing in either tier, the same scope finds its own entries in both."""
    tier, namespace, client = shared_tier
    calls, enc = counting_encoder()

    text = "a tenant's long document " * 20
    tenant_a, tenant_b = TENANT_SALT, "b2" * 32
    shared_scope(namespace)
    salt_scope(tenant_a)
    cached_encode(enc, "fp", "full", text)
    assert cached_encode(enc, "fp", "full", text) == enc(text) and len(calls) == 2  # a local hit
    _write(client, take_shared_writes())
    salt_scope(tenant_b)
    STATS.reset()
    cached_encode(enc, "fp", "full", text)
    assert (STATS.hits, STATS.misses) == (0, 1)  # neither tier answers another scope
    take_shared_writes()
    CACHE.clear()
    salt_scope(tenant_a)
    STATS.reset()
    cached_encode(enc, "fp", "full", text)
    assert (STATS.hits, STATS.shared_hits, STATS.misses) == (1, 1, 0)


@pytest.mark.parametrize("separate", [False, True])
def test_reply_writes_the_tier_in_its_pipeline_or_to_the_tiers_own_redis(shared_tier, monkeypatch, separate):
    """A render task's shared-tier entries are written by ``reply_if_requested``: in the reply's own pipeline, or,
    with ``SEGMENT_CACHE_REDIS_URL`` set, to that Redis (here another database of the test server) after it."""
    import redis

    from inference.workers import tasks

    tier, namespace, client = shared_tier
    kwargs = dict(client.connection_pool.connection_kwargs)
    if "host" not in kwargs:
        pytest.skip("the test Redis is not reached over TCP")
    own = redis.Redis(host=kwargs["host"], port=kwargs.get("port", 6379), username=kwargs.get("username"),
                      password=kwargs.get("password"), db=(int(kwargs.get("db", 0)) + 1) % 16)
    try:
        own.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no second database on the test Redis: {exc}")
    monkeypatch.setattr(tasks, "_reply_client", client)
    monkeypatch.setattr(tasks, "_segment_tier_client", own if separate else client)
    monkeypatch.setattr(tasks, "SETTINGS", dataclasses.replace(
        tasks.SETTINGS, segment_cache_redis_url="redis://tier.invalid/0" if separate else None))
    enable_shared_tier(tasks._segment_tier_redis, min_chars=200, ttl_s=60)
    shared_scope(namespace)
    salt_scope(TENANT_SALT)
    text = "a long turn of a conversation " * 20
    cached_encode(lambda s: [ord(c) for c in s], "fp", "full", text)
    key = tier.key(namespace, "fp", "full", hashlib.blake2b(text.encode(), digest_size=16,
                                                            key=bytes.fromhex(TENANT_SALT)).digest())
    try:
        answer = tasks.reply_if_requested({"reply_to": f"{namespace}:render:reply:t", "reply_id": "r1"}, {"ok": True})
        assert answer == {"ok": True, "replied": True}
        assert (own if separate else client).ttl(key) > 0
        assert not (client if separate else own).exists(key)
        assert take_shared_writes() == []  # handed over once
    finally:
        own.delete(key)
        own.close()


def test_a_tier_url_that_is_not_a_redis_url_leaves_the_tier_off(shared_tier, monkeypatch, caplog):
    """A malformed ``SEGMENT_CACHE_REDIS_URL`` turns the tier off at the worker's start (logged) instead of failing
    renders; a client factory that raises ``ValueError`` later only makes misses and a back-off."""
    from inference.workers import tasks
    from inference.renderer import segment_cache

    monkeypatch.setattr(tasks, "SETTINGS", dataclasses.replace(tasks.SETTINGS, segment_cache_redis_url="tier:6379"))
    with caplog.at_level("ERROR"):
        tasks._shared_segment_tier()
    assert segment_cache.SHARED is None and "not a Redis URL" in caplog.text

    def broken() -> None:
        raise ValueError("Redis URL must specify one of the following schemes")

    enable_shared_tier(broken, min_chars=200, ttl_s=60)
    tier, namespace, _client = shared_tier
    shared_scope(namespace)
    salt_scope(TENANT_SALT)
    text = "a long turn of a conversation " * 20
    STATS.reset()
    assert cached_encode(lambda s: [ord(c) for c in s], "fp", "full", text) == [ord(c) for c in text]
    assert STATS.misses == 1 and take_shared_writes() == []  # no writes queued while Redis does not answer
    assert segment_cache.SHARED is not None and not segment_cache.SHARED.available()
