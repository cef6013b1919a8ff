"""Helpers for tests against a live platform (``harness.live_platform.LivePlatform``): fixtures that start one,
keys with limits, JSON POSTs, an engine paused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from harness.assets import DEMO_MODEL
from harness.live_platform import LivePlatform, start_platform
from inference.protocol.engine import HEARTBEAT_TTL_S, REPLICAS_INDEX_TTL_MS, replica_key, replicas_index_key
from ops.supervisor import wait_until


# stops of platforms and engines whose fixtures ended: they run on threads while the next tests go on (a platform
# takes ~2 s to stop, a vLLM engine ~7 s, nothing of theirs is shared with later tests); pytest_sessionfinish
# (tests/conftest.py) waits for all of them, so no process outlives the session
_STOPPER = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fixture-stop")
_STOPS: list[tuple[str, Future[Any]]] = []


def stop_in_background(what: str, stop: Callable[[], Any]) -> None:
    """Run ``stop`` (a platform's or an engine's stop) on a thread; ``join_stops`` waits for it."""
    _STOPS.append((what, _STOPPER.submit(stop)))


def join_stops() -> list[str]:
    """Wait for every stop ``stop_in_background`` started; returns ``"what: error"`` for each that raised."""
    errors = []
    for what, future in _STOPS:
        try:
            future.result()
        except Exception as exc:  # noqa: BLE001 - reported by the caller, after every stop was waited for
            errors.append(f"{what}: {exc!r}")
    _STOPS.clear()
    return errors


@contextmanager
def running_platform(tmp_dir: Path, **start_kwargs: Any) -> Iterator[LivePlatform]:
    """``start_platform(tmp_dir, **start_kwargs)``, stopped when the block ends (an error in it included), on a thread
    (``stop_in_background``)."""
    live = start_platform(tmp_dir, **start_kwargs)
    try:
        yield live
    finally:
        stop_in_background(f"platform {tmp_dir.name}", live.stop)


def start_replica(live: LivePlatform, name: str, model: str, model_dir: str | Path, *args: str) -> None:
    """Start an engine replica ``name`` of ``model`` (``python -m inference.engine`` with ``args`` added) on
    ``live``'s Redis and prefix; wait (at most 180 s) until ``model`` has a heartbeat."""
    live.sup.start(name, [sys.executable, "-m", "inference.engine", "--model", model, "--model-dir", str(model_dir),
                          "--redis-url", live.redis_url, "--link-prefix", live.prefix, *args])
    wait_until(lambda: bool(live.replicas(model)), 180, f"{name} heartbeat", live.sup)


def ensure_model(live: LivePlatform, name: str, model_dir: str | Path, *register_args: str,
                 engine: bool = False) -> None:
    """Register served model ``name`` (``manage.py register_model name model_dir *register_args``) on ``live`` unless
    a fixture did already, and, with ``engine``, start its engine replica ``engine-<name>`` (waits for its
    heartbeat). For packages that share one platform (``shared_live``)."""
    done = live.extra.setdefault("registered", set())
    if name not in done:
        live.manage("register_model", name, str(model_dir), *register_args)
        if "embed" not in register_args:
            warm_tokenizer(live, name)
        done.add(name)
    if engine and f"engine-{name}" not in {child.name for child in live.sup.children}:
        live.start_engine(name=f"engine-{name}", model=name)


def stop_child(live: LivePlatform, name: str, grace_s: float = 10.0) -> None:
    """Stop ``live``'s child process(es) named ``name`` (SIGTERM to its process group, SIGKILL after ``grace_s``)
    and drop them from its supervisor."""
    for child in [c for c in live.sup.children if c.name == name]:
        if child.proc is not None:
            try:
                os.killpg(child.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                child.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                live.sup.kill_group(child)
                child.proc.wait()
            live.sup.kill_group(child)  # stragglers whose leader has exited
        live.sup.children.remove(child)


def warm_tokenizer(live: LivePlatform, model: str, rounds: int = 30) -> None:
    """Have every render worker load ``model``'s tokenizer: rounds of 8 concurrent ``/tokenize`` calls until three
    rounds in a row are all 200. A worker's first render of a newly registered model loads its tokenizer inside the render
    time limit (5 s), which a loaded machine can exceed (503 ``render_unavailable``, retryable)."""
    body = json.dumps({"model": model, "prompt": "warm up"}).encode()

    def one() -> int:
        req = urllib.request.Request(live.base_url + "/tokenize", data=body, method="POST", headers={
            "Authorization": f"Bearer {live.api_key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    good = 0  # consecutive rounds all 200: each round's calls spread over the render workers (prefetch aside)
    with ThreadPoolExecutor(8) as pool:
        for _ in range(rounds):
            good = good + 1 if all(code == 200 for code in pool.map(lambda _i: one(), range(8))) else 0
            if good == 3:
                return
    raise AssertionError(f"/tokenize of {model} did not answer 200 after {rounds} rounds")


def ensure_inline_api(live: LivePlatform) -> str:
    """The base URL of ``live``'s ``RENDER_ROUTE=inline`` api process, started on first use."""
    return live.extra.get("inline_url") or live.start_inline_api()


def platform_fixture(label: str, *, scope: str = "session", **start_kwargs: Any):
    """A pytest fixture (assign it to a name in a conftest or test module) yielding a platform started with
    ``start_platform(tmp dir "label", **start_kwargs)`` for ``scope``, stopped afterwards."""

    @pytest.fixture(scope=scope)
    def _platform(tmp_path_factory):
        with running_platform(tmp_path_factory.mktemp(label), **start_kwargs) as platform:
            yield platform

    return _platform


def limited_key(live, **limits: Any) -> str:
    """A new API key of ``live`` whose ``ApiKey`` fields ``limits`` (e.g. ``rpm_limit=1``) are set; its secret."""
    secret = live.new_key()
    sets = "; ".join(f"k.{name} = {value}" for name, value in limits.items())
    live.manage("shell", "-c", (
        "from tenancy.models import ApiKey; from tenancy.selectors import api_key_authenticate; "
        f"k = ApiKey.objects.get(pk=api_key_authenticate('{secret}').key_id); {sets}; k.save()"))
    return secret


def post_json(live, path: str, body: dict, *, key: str | None = None, timeout: float = 60) -> tuple[int, Any]:
    """POST ``body`` as JSON to ``live``'s ``path`` with ``key`` (default: the platform's key); returns
    ``(status, decoded JSON body)``, errors included."""
    req = urllib.request.Request(live.base_url + path, data=json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key or live.api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@contextmanager
def engine_paused(live: LivePlatform, model: str = DEMO_MODEL):
    """SIGSTOP ``model``'s (first) engine replica: requests it holds make no progress, admitted requests get
    no first token, until the block ends (SIGCONT). The heartbeat is held meanwhile (its key's TTL and its
    index score pushed 120 s ahead, the index's own expiry with it), so the replica stays alive however long the pause lasts on a slow
    machine; when it ends, both are set back to what the engine's own beat sets (``HEARTBEAT_TTL_S``), so a
    replica stopped again right afterwards is not kept alive by this hold."""
    st = live.replicas(model)[0]
    r = live.redis
    key, index = replica_key(live.prefix, model, st.engine_id), replicas_index_key(live.prefix, model)
    os.kill(st.pid, signal.SIGSTOP)
    try:
        r.pexpire(key, 120_000)
        r.zadd(index, {st.engine_id: int(time.time() * 1000) + 120_000})
        r.pexpire(index, 120_000 + REPLICAS_INDEX_TTL_MS)
        yield st
    finally:
        ttl_ms = int(HEARTBEAT_TTL_S * 1000)
        r.pexpire(key, ttl_ms)
        r.zadd(index, {st.engine_id: int(time.time() * 1000) + ttl_ms})
        r.pexpire(index, REPLICAS_INDEX_TTL_MS)
        os.kill(st.pid, signal.SIGCONT)
