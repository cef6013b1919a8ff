"""A render worker killed with ``kill -9`` while it holds one render started and one fetched and not started: both
requests are answered late by its replacement, none refused (issue 18; DECISIONS D-190, D-191).

Real pieces only: ``celery -A config worker -Q render`` (the platform's app, its heartbeat and its broker options, with
``CELERY_REDELIVER_AFTER_S`` as ``serve`` sets it), the api's ``RenderReplyWaiter`` on Redis, Celery's own ``inspect``
to see what the worker holds. The replacement starts after the waiter's fixed timeout has passed, so only the wait that
tracks the workers' beats keeps the requests alive."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from celery import Celery

from inference.api.render_client import RenderReplyWaiter
from inference.api.render_liveness import STALE_AFTER_S, liveness_key
from inference.renderer.chat_template import render_chat, render_template
from harness import REPO
from harness.assets import TOKENIZER_DIR, ensure_demo_assets
from tests.support.redis import TEST_REDIS_URL, fresh_prefix

pytestmark = pytest.mark.timeout(300)
TIMEOUT_S = 3.0  # the waiter's timeout while a worker is alive: shorter than the replacement's start
REDELIVER_AFTER_S = 4  # the visibility timeout (serve: the hard time limit + 1 s)
MESSAGES = [{"role": "user", "content": "Hello"}]


def _slow_template(seconds: float) -> str:
    """A chat template that loops for about ``seconds`` of this machine's CPU, then renders the messages (the
    worker runs it without the sandbox's operation budget and with a 60 s time limit)."""
    probe = "{% for a in range(100) %}{% for b in range(1000) %}{% endfor %}{% endfor %}"
    t0 = time.perf_counter()
    render_template(probe, {}, max_output_chars=1 << 20, max_ops=10**9)
    rounds = max(100, min(100_000, int(100 * seconds / max(time.perf_counter() - t0, 1e-3))))
    return ("{% for a in range(" + str(rounds) + ") %}{% for b in range(1000) %}{% endfor %}{% endfor %}"
            "{% for m in messages %}{{ m.content }}{% endfor %}")


class _Worker:
    """One ``celery -A config worker -Q render -c 1`` of ``pool`` in its own process group (solo: one task fetched
    at a time, as ``serve`` runs it)."""

    def __init__(self, env: dict[str, str], name: str, log: Path, pool: str = "prefork"):
        self.name = name
        if pool == "solo":
            env = {**env, "CELERY_WORKER_PREFETCH_MULTIPLIER": "1"}
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "config", "worker", "-Q", "render", "-c", "1", "--pool",
                 pool, "-n", name, "--without-gossip", "--without-mingle", "-l", "WARNING"],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        """``kill -9`` of the whole group (the main process and its pool child), as ``serve`` replaces one."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def render_env(tmp_path):
    client = redis.Redis.from_url(TEST_REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {TEST_REDIS_URL}: {exc}")
    ensure_demo_assets()
    with fresh_prefix("rdeath") as prefix:
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "EMBEDDED_REDIS_PORT")}
        env.update({"PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)]), "LINK_PREFIX": prefix,
                    "REDIS_URL": TEST_REDIS_URL, "LLMP_VAR_DIR": str(tmp_path), "DJANGO_SETTINGS_MODULE": "config.settings",
                    "DJANGO_SECRET_KEY": "rdeath-" + uuid.uuid4().hex, "LOG_LEVEL": "WARNING",
                    "CELERY_REDELIVER_AFTER_S": str(REDELIVER_AFTER_S), "RENDER_TIME_LIMIT_S": "60",
                    "RENDER_MAX_OPS": str(10**12)})
        workers: list[_Worker] = []
        try:
            yield env, prefix, client, workers
        finally:
            for w in workers:
                w.kill()
            client.close()


def _held(client: redis.Redis, prefix: str) -> tuple[int, int]:
    """(tasks fetched by workers and not acknowledged, tasks still in the ``render`` queue) in the broker."""
    return client.hlen(f"{prefix}:celery:unacked_redeliver"), client.llen(f"{prefix}:celery:render")


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_killed_render_worker_started_and_fetched_renders_are_answered(render_env, tmp_path, pool):
    env, prefix, client, workers = render_env
    sender = Celery("rdeath-sender", broker=TEST_REDIS_URL)
    sender.conf.update(broker_transport_options={"global_keyprefix": f"{prefix}:celery:"},
                       broker_connection_retry_on_startup=True)
    tok = str(TOKENIZER_DIR)
    slow = _slow_template(2.5)
    first = _Worker(env, f"rdeath1-{prefix}@%h", tmp_path / "w1.log", pool)
    workers.append(first)
    alive = lambda: client.exists(liveness_key(prefix)) == 1

    async def scenario():
        waiter = RenderReplyWaiter(TEST_REDIS_URL, prefix)

        async def render(template: str | None):
            payload = {"tokenizer_dir": tok, "messages": MESSAGES, "chat_template": template}
            out = await waiter.call(sender, "inference.render_chat", payload, queue="render", timeout=TIMEOUT_S,
                                    worker_return=90)
            return out, time.monotonic()

        await asyncio.to_thread(_wait, alive, 120, "the first worker's heartbeat")
        for _ in range(20):  # the pool child is up and has the tokenizer loaded
            try:
                warm, _ = await render(None)
                break
            except Exception:  # noqa: BLE001  (a slow start on a busy machine: try again)
                continue
        assert warm["ok"], warm

        started = asyncio.create_task(render(slow))
        await asyncio.sleep(0.3)
        fetched = asyncio.create_task(render(None))

        def holds_both() -> bool:
            # read in the broker, not by Celery's broadcast `inspect` (whose replies took longer than the slow
            # render's 2.5 s on a busy machine, so the state was never seen): a solo worker has fetched only the one
            # it runs; a prefork worker of one child has fetched both, runs the first (sent 0.3 s earlier) and holds
            # the second until the first ends, when both are acknowledged
            return _held(client, prefix) == ((1, 1) if pool == "solo" else (2, 0))

        await asyncio.to_thread(_wait, holds_both, 60, "the worker to hold a started and a fetched render")
        first.kill()
        killed = time.monotonic()
        await asyncio.sleep(TIMEOUT_S + STALE_AFTER_S)  # past the fixed timeout, with no render worker alive
        assert not started.done() and not fetched.done()
        workers.append(_Worker(env, f"rdeath2-{prefix}@%h", tmp_path / "w2.log", pool))
        (slow_out, slow_at), (fast_out, fast_at) = await asyncio.gather(started, fetched)
        return slow_out, slow_at, fast_out, fast_at, killed

    slow_out, slow_at, fast_out, fast_at, killed = asyncio.run(scenario())
    want = render_chat(tok, MESSAGES).prompt_token_ids
    assert slow_out["ok"] and fast_out["ok"], (slow_out, fast_out)
    assert fast_out["prompt_token_ids"] == want
    assert slow_out["prompt_text"].endswith("Hello")
    # both answered by the replacement, after the kill and after the fixed timeout would have refused them
    assert min(slow_at, fast_at) > killed + TIMEOUT_S


def test_a_render_that_lost_its_solo_worker_twice_is_answered_with_an_error(render_env, tmp_path):
    """A render whose worker is killed while it runs is run again once by another worker; killed again there, its
    third copy is answered with a 503 error instead of run (``inference.workers.render_limits.redelivery_refusal``: a task
    that kills every worker that takes it, such as one past the hard time limit, takes at most two; D-296)."""
    env, prefix, client, workers = render_env
    sender = Celery("rdeath-sender", broker=TEST_REDIS_URL)
    sender.conf.update(broker_transport_options={"global_keyprefix": f"{prefix}:celery:"},
                       broker_connection_retry_on_startup=True)
    tok = str(TOKENIZER_DIR)
    slow = _slow_template(30)  # runs until it is killed
    workers.append(_Worker(env, f"rtwice1-{prefix}@%h", tmp_path / "t1.log", "solo"))
    alive = lambda: client.exists(liveness_key(prefix)) == 1
    marks = lambda: [int(client.get(k) or 0) for k in client.scan_iter(match=f"{prefix}:render:redelivered:*")]

    async def scenario():
        waiter = RenderReplyWaiter(TEST_REDIS_URL, prefix)

        async def render(template: str | None):
            payload = {"tokenizer_dir": tok, "messages": MESSAGES, "chat_template": template}
            # waits for as long as the scenario takes: this test is about the workers, not the api's wait
            return await waiter.call(sender, "inference.render_chat", payload, queue="render", timeout=120,
                                     worker_return=120)

        await asyncio.to_thread(_wait, alive, 120, "the first worker's heartbeat")
        for _ in range(20):
            try:
                warm = await render(None)
                break
            except Exception:  # noqa: BLE001  (a slow start on a busy machine: try again)
                continue
        assert warm["ok"], warm
        doomed = asyncio.create_task(render(slow))
        await asyncio.to_thread(_wait, lambda: _held(client, prefix) == (1, 0), 60, "the first worker to run it")
        await asyncio.sleep(0.5)
        workers[0].kill()
        workers.append(_Worker(env, f"rtwice2-{prefix}@%h", tmp_path / "t2.log", "solo"))
        # the replacement runs the copy handed back (the first redelivery is run, its mark counts 1) ...
        await asyncio.to_thread(_wait, lambda: marks() == [1] and _held(client, prefix) == (1, 0), 120,
                                "the second worker to run the copy handed back")
        await asyncio.sleep(0.5)
        assert not doomed.done()
        workers[1].kill()
        workers.append(_Worker(env, f"rtwice3-{prefix}@%h", tmp_path / "t3.log", "solo"))
        out = await doomed
        # ... and the third worker still serves
        after = await render(None)
        return out, after

    out, after = asyncio.run(scenario())
    assert out["ok"] is False and out["error"]["type"] == "RenderOverloadedError", out
    assert "twice" in out["error"]["message"]
    assert marks() == [2]
    assert after["ok"] and after["prompt_token_ids"] == render_chat(tok, MESSAGES).prompt_token_ids
