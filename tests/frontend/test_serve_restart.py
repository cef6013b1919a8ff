"""``manage.py serve`` brings a killed api process back (issue 17): ``kill -9`` of the api while it streams; the
stream's client sees its connection closed, serve starts a new api on the same port that serves within a bound,
every other process keeps running (same pids), the dead api's admission reservation is reaped, the engine aborts
its generation, and its key-limit concurrency slot expires. Also checks the default layout serve chose (torch threads
from ops/layout.py; engines and background workers at nice 10, the api, render worker and Redis not)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import redis

from inference.api import admission as adm
from inference.protocol.engine import EngineStats, replica_pattern
from ops.layout import engine_threads
from harness.assets import DEMO_MODEL, ensure_demo_assets
from harness import REPO
from harness.live_platform import free_port, run_manage
from ops.supervisor import wait_until
from harness.redis_keys import delete_prefix
from harness.serve import banner_key, child_pids, cmdline, serve_banner, serve_env, serve_redis_url, stop_serve

API_BACK_WITHIN_S = 90  # kill -9 to /health answering on the same port (Django's start-up, on a busy 2-core box)
LONG_STREAM = {"model": DEMO_MODEL, "messages": [{"role": "user", "content": "tell me a long story"}],
               "max_tokens": 1500, "ignore_eos": True, "stream": True}


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[16])


def _replicas(r: redis.Redis, prefix: str) -> list[EngineStats]:
    keys = list(r.scan_iter(match=replica_pattern(prefix, DEMO_MODEL)))
    return [EngineStats.from_wire(v) for v in r.mget(keys) if v] if keys else []


def _limited_key(env: dict) -> str:
    """A new API key of a new tenant with ``max_concurrent_requests = 1``; its secret."""
    secret = run_manage(env, "create_api_key", "--tenant", "restart-t", "--name", "k").strip().splitlines()[-1].strip()
    run_manage(env, "shell", "-c", (
        "from tenancy.models import ApiKey; from tenancy.selectors import api_key_authenticate; "
        f"k = ApiKey.objects.get(pk=api_key_authenticate('{secret}').key_id); k.max_concurrent_requests = 1; k.save()"))
    return secret


def test_serve_restarts_a_killed_api_on_its_port_and_nothing_else_stops(tmp_path):
    ensure_demo_assets()
    env = serve_env(tmp_path)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, str(REPO / "manage.py"), "serve", "--demo", "--port", str(port),
                             "--engine-step-watchdog-s", "120"],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        banner = serve_banner(proc.stdout, 600)
        key = banner_key(banner)
        r = redis.Redis.from_url(serve_redis_url(env, tmp_path))
        prefix = env["LINK_PREFIX"]
        kids = {pid: cmdline(pid) for pid in child_pids(proc.pid)}
        api = next(p for p, c in kids.items() if "uvicorn" in c and f"--port {port}" in c)
        others = {p: c for p, c in kids.items() if p != api}
        assert len(others) >= 6, kids  # redis, worker, worker-usage, worker-mm, beat, engine, api-mm

        # the default layout: the demo's CPU engines (chat, embeddings) share the cores less one for the frontend,
        # at nice 10
        engines = [p for p, c in others.items() if "inference.engine" in c]
        want = engine_threads(len(os.sched_getaffinity(0)), len(engines), 1)
        for engine in engines:
            assert f"--num-threads {want} " in cmdline(engine) + " ", cmdline(engine)
            assert "--step-watchdog-s 120.0 " in cmdline(engine) + " ", cmdline(engine)  # serve passes its bound on
            assert _nice(engine) == min(19, os.nice(0) + 10)
        assert _nice(api) == os.nice(0)
        # background work niced too; the render worker (every request's path) and Redis are not
        for pid, cmd in others.items():
            background = any(m in cmd for m in ("-Q usage", "-Q mm", "config beat"))
            assert _nice(pid) == (min(19, os.nice(0) + 10) if background or "inference.engine" in cmd else os.nice(0)), cmd
        assert any(ln.startswith(f"engines: {len(engines)}, each at nice 10; CPU engines {want} torch thread")
                   for ln in banner), banner

        limited = _limited_key(env)
        with httpx.Client(base_url=base, timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as http:
            # a long stream held by the api that is about to die
            with http.stream("POST", "/v1/chat/completions", json=LONG_STREAM,
                             headers={"Authorization": f"Bearer {limited}"}) as stream:
                assert stream.status_code == 200
                lines = stream.iter_lines()
                first = next(ln for ln in lines if ln.startswith("data: "))
                assert json.loads(first[6:])["object"] == "chat.completion.chunk"
                assert adm.model_snapshot(r, prefix, DEMO_MODEL)["queued_reqs"] == 1
                killed_at = time.monotonic()
                os.kill(api, signal.SIGKILL)
                # the client sees its connection closed (no [DONE], no hang)
                rest: list[str] = []
                try:
                    for ln in lines:
                        rest.append(ln)
                except (httpx.RemoteProtocolError, httpx.ReadError):
                    pass
                else:
                    raise AssertionError(f"the stream ended normally after the kill: {rest[-3:]}")
                assert "data: [DONE]" not in rest
            assert time.monotonic() - killed_at < 10

            # a new api on the same port, within the bound
            wait_until(lambda: _health(http), API_BACK_WITHIN_S, "the restarted api on its port")
            back_s = time.monotonic() - killed_at
            assert proc.poll() is None, "serve stopped"
            kids_now = {pid: cmdline(pid) for pid in child_pids(proc.pid)}
            new_api = [p for p, c in kids_now.items() if "uvicorn" in c and f"--port {port}" in c]
            assert new_api and new_api[0] != api, kids_now
            assert {p: kids_now.get(p) for p in others} == others  # nothing else was restarted or stopped

            # it serves: the official client, non-streamed and streamed
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
            done = client.chat.completions.create(model=DEMO_MODEL, max_tokens=4,
                                                  messages=[{"role": "user", "content": "hi"}])
            assert done.choices[0].finish_reason in ("stop", "length")
            chunks = list(client.chat.completions.create(model=DEMO_MODEL, max_tokens=4, stream=True,
                                                         messages=[{"role": "user", "content": "hi"}]))
            assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")

            # what the dead api held is given back: its admission reservation (reaped by the live api's lease
            # loop), the engine's running sequence (aborted when the dead api's liveness key lapses) and the
            # key's concurrency slot (its lease expires, tenancy/limits.py)
            wait_until(lambda: adm.model_snapshot(r, prefix, DEMO_MODEL)["queued_reqs"] == 0, 15,
                       "the dead api's admission reservation reaped")
            wait_until(lambda: all(s.num_running == 0 and s.num_waiting == 0 for s in _replicas(r, prefix)), 30,
                       "the engine to abort the dead api's generation")

            def slot_free() -> bool:
                resp = http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {limited}"},
                                 json={"model": DEMO_MODEL, "max_tokens": 2, "messages": [{"role": "user",
                                                                                           "content": "hi"}]})
                assert resp.status_code in (200, 429), resp.text
                if resp.status_code == 429:
                    time.sleep(1)
                return resp.status_code == 200
            wait_until(slot_free, 60, "the dead api's key-limit slot to expire")
            slot_s = time.monotonic() - killed_at
        print(f"\napi back on port {port} {back_s:.1f} s after kill -9; key slot free after {slot_s:.1f} s")
    finally:
        stop_serve(proc)
        if env.get("REDIS_URL"):
            delete_prefix(env["REDIS_URL"], env["LINK_PREFIX"])


def _health(http: httpx.Client) -> bool:
    try:
        return http.get("/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
