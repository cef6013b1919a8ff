"""``manage.py serve`` as the README runs it, with ``--frontend-cores``: the front api alone on its core, every
other process on the rest, image requests handed to the multimodal api process (restarted when killed; the
front covers for it meanwhile; one that keeps crashing is set aside, and so is a render worker), and bad
``--frontend-cores`` values refused before anything starts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from ops.supervisor import parse_cpu_list, wait_until
from harness import REPO
from harness.assets import ensure_demo_assets
from harness.live_platform import free_port
from harness.images import data_url, image_bytes
from harness.redis_keys import delete_prefix
from harness.serve import banner_key, child_pids, cmdline, serve_banner, serve_env, serve_redis_url, stop_serve

IMAGE_BODY = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": data_url(image_bytes(seed=3))}}]}]}


def _cpus(pid: int) -> frozenset[int]:
    text = Path(f"/proc/{pid}/status").read_text()
    return parse_cpu_list(re.search(r"Cpus_allowed_list:\s*(\S+)", text).group(1))


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = child_pids(todo.pop())
        found += kids
        todo += kids
    return found


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--frontend-cores needs at least two usable CPUs")
def test_serve_pins_the_front_api_and_hands_images_to_the_multimodal_api(tmp_path):
    ensure_demo_assets()
    env = serve_env(tmp_path)
    port = free_port()
    front_core = min(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, str(REPO / "manage.py"), "serve", "--demo", "--no-engine", "--port",
                             str(port), "--frontend-cores", str(front_core)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        key = banner_key(serve_banner(proc.stdout, 180))
        redis_url = serve_redis_url(env, tmp_path)
        procs = {pid: cmdline(pid) for pid in _descendants(proc.pid)}
        fronts = [p for p, c in procs.items() if "uvicorn" in c and "--port" in c]
        mm_apis = [p for p, c in procs.items() if "ops.mm_api" in c]
        assert fronts and mm_apis, procs
        back = frozenset(os.sched_getaffinity(0)) - {front_core}
        for pid, cmd in procs.items():
            if not cmd:
                continue  # exited since
            want = frozenset({front_core}) if pid in fronts else back
            assert _cpus(pid) == want, (cmd, _cpus(pid), want)

        r = redis.Redis.from_url(redis_url)
        counts = lambda: {k.decode(): int(v) for k, v in r.hgetall(f"{env['LINK_PREFIX']}:handoff").items()}
        base = f"http://127.0.0.1:{port}"
        # a connection per request, as separate clients would send them
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30,
                          limits=httpx.Limits(max_keepalive_connections=0)) as http:
            # a text model refuses images: the multimodal api's 400, relayed by the front
            resp = http.post("/v1/chat/completions", json=IMAGE_BODY)
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "images_not_supported", resp.text
            assert counts().get("forwarded") == 1
            # a chunked body is relayed as it arrives: same answer
            raw = json.dumps(IMAGE_BODY).encode()
            resp = http.post("/v1/chat/completions", content=iter([raw[:100], raw[100:]]),
                             headers={"Content-Type": "application/json"})
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "images_not_supported", resp.text
            assert counts().get("forwarded") == 2
            # kill the multimodal api: the front answers image requests itself, serve restarts it
            os.killpg(os.getpgid(mm_apis[0]), signal.SIGKILL)
            # gone from /proc (reaped by serve), not merely a zombie: a killed thread group leader shows Z while its
            # other threads still hold the sockets open
            wait_until(lambda: not os.path.exists(f"/proc/{mm_apis[0]}"), 10, "the multimodal api to be reaped")
            resp = http.post("/v1/chat/completions", json=IMAGE_BODY)
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "images_not_supported", (resp.text, counts())
            assert counts().get("fallback") == 1

            def handed_over_again() -> bool:
                before = counts().get("forwarded", 0)
                http.post("/v1/chat/completions", json=IMAGE_BODY)
                return counts().get("forwarded", 0) == before + 1

            wait_until(handed_over_again, 60, "the restarted multimodal api")
            new_mm = [p for p in _descendants(proc.pid) if "ops.mm_api" in cmdline(p)]
            assert new_mm and new_mm[0] != mm_apis[0] and _cpus(new_mm[0]) == back

            # a multimodal api that keeps crashing uses up its restart budget (5 a minute): serve sets it aside
            # and goes on, the front serving image requests itself; text is never affected
            sock = Path(env["LLMP_VAR_DIR"]) / "run" / "mm-api.sock"
            for _ in range(5):
                wait_until(lambda: [p for p in _descendants(proc.pid) if "ops.mm_api" in cmdline(p)]
                           and sock.exists(), 60, "a multimodal api")
                pid = next(p for p in _descendants(proc.pid) if "ops.mm_api" in cmdline(p))
                os.killpg(os.getpgid(pid), signal.SIGKILL)
                wait_until(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), 10, "the multimodal api to be reaped")
            time.sleep(1.5)
            assert proc.poll() is None, "serve stopped"
            assert not [p for p in _descendants(proc.pid) if "ops.mm_api" in cmdline(p)]
            resp = http.post("/v1/chat/completions", json=IMAGE_BODY)
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "images_not_supported", resp.text
            tok = http.post("/tokenize", json={"model": "tiny-qwen3", "prompt": "hello"})
            assert tok.status_code == 200, tok.text

            # so is a render worker that keeps dying (a tenant's template killed by the hard time limit again and
            # again, D-296): the other one renders, and serve goes on
            def worker2() -> list[int]:  # its main process (a child of serve's), not its watchdog
                return [p for p in child_pids(proc.pid) if "worker2@" in cmdline(p) and "-Q render" in cmdline(p)]

            for _ in range(6):
                wait_until(worker2, 60, "render worker 2")
                pid = worker2()[0]
                os.killpg(os.getpgid(pid), signal.SIGKILL)
                wait_until(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), 10, "render worker 2 to be reaped")
            time.sleep(1.5)
            assert proc.poll() is None, "serve stopped"
            assert not worker2()
            for i in range(4):
                tok = http.post("/tokenize", json={"model": "tiny-qwen3", "prompt": f"hello {i}"})
                assert tok.status_code == 200, tok.text
    finally:
        stop_serve(proc)
        if env.get("REDIS_URL"):
            delete_prefix(env["REDIS_URL"], env["LINK_PREFIX"])


@pytest.mark.parametrize("value,message", [("x", "not a CPU list"), ("3-1", "empty range"),
                                           ("4096", "not available here"),
                                           (",".join(map(str, sorted(os.sched_getaffinity(0)))), "leaves no CPU")])
def test_serve_refuses_a_bad_frontend_cores_value(tmp_path, value, message):
    out = subprocess.run([sys.executable, str(REPO / "manage.py"), "serve", "--no-engine", "--frontend-cores", value],
                         env=serve_env(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and message in out.stderr, out.stderr
    assert not (tmp_path / "log").exists()  # refused before any process started


def test_parse_cpu_list():
    assert parse_cpu_list("0") == {0}
    assert parse_cpu_list("0,2-4") == {0, 2, 3, 4}
    for bad in ("", "a", "1-", "-1", "2-1", "0,,1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)
