"""``inference.workers.render_limits``: the time limits a ``solo`` render worker enforces itself, and the guard that stops
a task that lost its worker twice (DECISIONS D-296). The limits run in a child Python process (the hard limit exits
it); the guard runs on the test Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from inference.workers import render_limits
from tests.support.redis import redis_or_skip

REPO = Path(__file__).resolve().parents[2]


def _run(code: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("DJANGO_SETTINGS_MODULE", None)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=timeout)
    return out, time.monotonic() - t0


PRELUDE = (
    "import time\n"
    "from celery.exceptions import SoftTimeLimitExceeded\n"
    "from inference.workers import render_limits\n"
    "render_limits.enable(0.3, 1.0)\n"
)


def test_soft_limit_stops_python_code_and_the_process_lives_on():
    code = PRELUDE + (
        "t0 = time.monotonic()\n"
        "try:\n"
        "    with render_limits.task_time_limits():\n"
        "        while True:\n"
        "            pass\n"
        "except SoftTimeLimitExceeded:\n"
        "    print('soft', round(time.monotonic() - t0, 1))\n"
        "with render_limits.task_time_limits():\n"
        "    x = sum(range(1000))\n"  # a task within the limits: nothing fires, now or later
        "time.sleep(1.5)\n"  # past the hard limit of both tasks: it was disarmed
        "print('alive')\n"
    )
    out, _ = _run(code)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[0] == "soft" and 0.25 <= float(lines[1]) <= 0.9 and lines[-1] == "alive", out.stdout


# builtin sum over a range runs in C and never checks for signals: the SIGALRM handler cannot run, only the watchdog
# ends it (about a minute of work otherwise)
STUCK_IN_C = (
    "with render_limits.task_time_limits():\n"
    "    sum(range(10**11))\n"
    "print('not stopped')\n"
)


def _run_stuck(before: str = "") -> str:
    """Run ``before`` then a task stuck in C code under the limits (0.3 / 1.0 s); assert its process was killed
    within seconds, not left to finish; return its stderr."""
    out, took = _run(PRELUDE + before + STUCK_IN_C, timeout=120)
    assert out.returncode == -signal.SIGKILL and "not stopped" not in out.stdout, (out.returncode, out.stderr)
    assert took < 15, took
    return out.stderr


def test_hard_limit_exits_a_process_stuck_in_c_code_holding_the_gil():
    stderr = _run_stuck()
    # faulthandler's dump on the watchdog's SIGUSR2, before the kill: where the task was stuck
    assert "most recent call first" in stderr and 'File "<string>", line 6' in stderr, stderr


def test_a_killed_watchdog_is_replaced_before_the_next_task():
    stderr = _run_stuck(
        "import os, signal\n"
        "first = render_limits.watchdog_pid()\n"
        "os.kill(first, signal.SIGKILL)\n"
        "time.sleep(0.3)\n"
        "with render_limits.task_time_limits():\n"
        "    assert render_limits.watchdog_pid() != first\n"
    )
    assert "exited; starting another" in stderr and "most recent call first" in stderr, stderr


def test_limits_are_off_unless_enabled_and_off_the_main_thread():
    code = (
        "import threading, time\n"
        "from inference.workers import render_limits\n"
        "with render_limits.task_time_limits():\n"  # not enabled: a test runner or shell calling a task body
        "    time.sleep(0.2)\n"
        "render_limits.enable(0.1, 0.2)\n"
        "def body():\n"
        "    with render_limits.task_time_limits():\n"  # the inline pool's threads in the api
        "        time.sleep(0.5)\n"
        "t = threading.Thread(target=body); t.start(); t.join()\n"
        "print('ok')\n"
    )
    out, _ = _run(code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    with pytest.raises(ValueError):
        render_limits.enable(2.0, 1.0)


def test_the_watchdog_leaves_with_its_worker():
    # the forked watchdog holds the worker's stdout and stderr: the pipes end (and the run returns) only once it has
    # left too, which it does on its next look after the worker exits
    out, took = _run(PRELUDE + "print('done')\n", timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr
    assert took < 10, took


def test_a_task_handed_back_twice_is_refused_on_its_second_copy():
    client = redis_or_skip()
    prefix, task_id = f"rlim-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    key = render_limits.redelivery_mark_key(prefix, task_id)
    try:
        # the first copy handed back runs (its worker was killed: answered late) ...
        assert render_limits.redelivery_refusal(client, prefix, task_id) is False
        assert 0 < client.ttl(key) <= render_limits.REDELIVERY_MARK_TTL_S
        # ... a second one does not (the task's run lost its worker twice)
        assert render_limits.redelivery_refusal(client, prefix, task_id) is True
        other = uuid.uuid4().hex
        assert render_limits.redelivery_refusal(client, prefix, other) is False
        assert render_limits.redelivery_refusal(client, prefix, "") is False  # no id: nothing to count by
        client.delete(render_limits.redelivery_mark_key(prefix, other))
    finally:
        client.delete(key)
        client.close()


def test_copies_handed_back_or_sent_again_count_per_request(monkeypatch):
    """``inference.workers.tasks.run_task``: a request's render runs at most twice, whether its second copy came back from
    the broker (a lost worker) or from the api sending it again (its reply timer; render_client); the third copy of
    either kind is answered with the error, not run."""
    from types import SimpleNamespace

    from inference.workers import tasks

    client = redis_or_skip()
    # the worker's reply client on the test Redis (it reads REDIS_URL, else the embedded Redis a platform starts)
    monkeypatch.setattr(tasks, "_reply_client", client)
    prefix, reply_id = f"rlim-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    channel = f"{prefix}:render:reply:test"
    payload = {"reply_to": channel, "reply_id": reply_id, "client_chat_template": True}
    ran: list[dict] = []

    def body(p):
        ran.append(p)
        return {"ok": True}

    def task(redelivered: bool):
        return SimpleNamespace(request=SimpleNamespace(id=uuid.uuid4().hex, delivery_info={"redelivered": redelivered}))

    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(channel)
    try:
        assert tasks.run_task(task(False), payload, body)["replied"]  # the first copy: no mark
        assert client.exists(render_limits.redelivery_mark_key(prefix, reply_id)) == 0
        assert tasks.run_task(task(True), payload, body)["ok"]  # handed back once: runs
        out = tasks.run_task(task(False), {**payload, "resent": True}, body)  # sent again after that: refused
        assert out == {"ok": False, "replied": True} and len(ran) == 2
        replies = []
        for _ in range(50):
            msg = pubsub.get_message(timeout=0.1)
            if msg is not None:
                replies.append(json.loads(msg["data"]))
            if len(replies) == 3:
                break
        assert [r["result"]["ok"] for r in replies] == [True, True, False]
        err = replies[2]["result"]["error"]
        # the client's own template: a 400 naming it
        assert err["type"] == "TemplateTimeoutError" and err["param"] == "chat_template" and "twice" in err["message"]
    finally:
        pubsub.close()
        client.delete(render_limits.redelivery_mark_key(prefix, reply_id), tasks.render_tasks_counter_key(prefix))
        client.close()
