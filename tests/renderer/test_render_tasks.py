"""inference.workers.tasks: structured results in-process, and a real prefork Celery worker on Redis
(time limits only work in a real worker: the soft limit is a signal in the pool child)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from inference.renderer.chat_template import render_chat
from inference.workers.tasks import render_chat_task, run_detokenize, run_render_chat, run_tokenize_prompt
from tests.renderer.tokdirs import tok_dir

REPO = Path(__file__).resolve().parents[2]
BASIC = [{"role": "user", "content": "Hello"}]
HANG = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"


def test_time_limit_blames_the_template_only_when_the_template_took_the_time(monkeypatch):
    """A soft time limit that fires while the worker was busy elsewhere (cold tokenizer load, CPU starvation) is
    the server's fault: RenderOverloadedError (503 at the gateway); one that fires after the template used at
    least half the limit is the client's: TemplateTimeoutError (400)."""
    from celery.exceptions import SoftTimeLimitExceeded

    from inference.workers import tasks
    from inference.renderer.chat_template import render_template, reset_template_seconds, template_seconds

    monkeypatch.setattr(tasks, "RENDER_TIME_LIMIT_S", 0.02)
    reset_template_seconds()
    assert tasks._error(SoftTimeLimitExceeded())["error"]["type"] == "RenderOverloadedError"
    slow = "{% for a in range(400) %}{% for b in range(100) %}{{ '' }}{% endfor %}{% endfor %}"
    for _ in range(10_000):  # render until the template has used half the limit, however fast the machine
        render_template(slow, {}, max_output_chars=1 << 20, max_ops=10**7)
        if template_seconds() >= 0.01:
            break
    assert template_seconds() >= 0.01
    assert tasks._error(SoftTimeLimitExceeded())["error"]["type"] == "TemplateTimeoutError"
    reset_template_seconds()  # every task starts from zero
    assert tasks._error(SoftTimeLimitExceeded())["error"]["type"] == "RenderOverloadedError"


def test_run_render_chat_ok_and_errors():
    d = tok_dir("qwen3")
    ok = run_render_chat({"tokenizer_dir": d, "messages": BASIC, "chat_template_kwargs": {"enable_thinking": False}})
    ref = render_chat(d, BASIC, chat_template_kwargs={"enable_thinking": False})
    assert ok == {"ok": True, "prompt_text": ref.prompt_text, "prompt_token_ids": ref.prompt_token_ids}

    err = run_render_chat({"tokenizer_dir": tok_dir("gptoss"), "messages": BASIC})
    assert err["ok"] is False and err["error"]["type"] == "NoChatTemplateError" and err["error"]["param"] == "messages"

    err = run_render_chat({"tokenizer_dir": d, "messages": BASIC, "chat_template": "{{ raise_exception('nope') }}"})
    assert err["error"] == {"type": "TemplateRenderError", "message": "nope", "param": "messages",
                            "code": "invalid_prompt"}

    err = run_render_chat({"tokenizer_dir": d, "messages": BASIC, "chat_template": HANG})
    assert err["error"]["type"] == "TemplateLimitError" and err["error"]["code"] == "template_limit"

    err = run_render_chat({"messages": BASIC})
    assert err["ok"] is False and err["error"]["param"] == "tokenizer_dir"


def test_tokenize_and_detokenize_tasks():
    d = tok_dir("llama3_1")
    out = run_tokenize_prompt({"tokenizer_dir": d, "prompt": "Hi"})
    assert out["ok"] and out["prompt_token_ids"][0] == 128000
    assert run_detokenize({"tokenizer_dir": d, "tokens": out["prompt_token_ids"], "skip_special_tokens": True}) == {
        "ok": True,
        "prompt": "Hi",
    }
    bad = run_detokenize({"tokenizer_dir": d, "tokens": [10**9]})
    assert bad["ok"] is False and bad["error"]["type"] == "TokenIdError" and str(10**9) in bad["error"]["message"]


def test_task_objects_are_registered_with_their_names():
    assert render_chat_task.name == "inference.render_chat"
    assert render_chat_task.soft_time_limit > 0 and render_chat_task.time_limit > render_chat_task.soft_time_limit
    # Executes the real task body locally (no broker).
    res = render_chat_task.apply(args=({"tokenizer_dir": tok_dir("qwen3"), "messages": BASIC},)).get()
    assert res["ok"] is True


def test_reply_json_reads_back_as_the_reply():
    import json

    from inference.api.render_client import parse_reply
    from inference.workers.tasks import reply_json

    for reply in ({"id": "a", "result": {"ok": True, "prompt_text": "é 東京 \u2028 🙂", "prompt_token_ids": [1, 2]}},
                  {"id": "b", "result": {"ok": True, "prompt_text": "lone \ud800", "n": 2**70}}):  # stdlib path
        assert json.loads(reply_json(reply)) == reply
        assert parse_reply(reply_json(reply)) == reply  # the api's reader: orjson, else the standard library
    with pytest.raises(ValueError):
        parse_reply(b"{not json")


def test_a_replied_task_returns_a_stand_in(monkeypatch):
    """With a reply channel the result goes there, whole, and the task returns only ``{"ok", "replied"}`` (what the
    prefork child reprs and pickles to its parent); without one, the result itself."""
    import json

    import redis

    from inference.workers import tasks
    from tests.support.redis import TEST_REDIS_URL, fresh_prefix

    client = redis.Redis.from_url(TEST_REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {TEST_REDIS_URL}: {exc}")
    monkeypatch.setattr(tasks, "_reply_client", client)
    payload = {"tokenizer_dir": tok_dir("qwen3"), "prompt": "Hello"}
    result = run_tokenize_prompt(payload)
    assert tasks.reply_if_requested(payload, result) is result
    with fresh_prefix("reply") as prefix:
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        channel = f"{prefix}:render:reply:test"
        pubsub.subscribe(channel)
        answer = tasks.reply_if_requested({**payload, "reply_to": channel, "reply_id": "r1"}, result)
        assert answer == {"ok": True, "replied": True}
        msg = None
        for _ in range(50):
            msg = pubsub.get_message(timeout=0.1)
            if msg is not None:
                break
        assert msg is not None and json.loads(msg["data"]) == {"id": "r1", "result": result}
        assert int(client.get(tasks.render_tasks_counter_key(prefix))) == 1
        pubsub.close()
    client.close()


@pytest.fixture(scope="module", params=["prefork", "solo"])
def worker(request):
    redis = pytest.importorskip("redis")
    url = os.environ.get("RENDER_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
    try:
        redis.Redis.from_url(url).ping()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no Redis at {url}: {exc}")
    queue = f"render-test-{uuid.uuid4().hex[:8]}"
    env = dict(
        os.environ,
        RENDER_TEST_REDIS_URL=url,
        RENDER_TIME_LIMIT_S="1.5",
        RENDER_HARD_TIME_LIMIT_EXTRA_S="2",
        RENDER_MAX_OPS=str(10**12),  # disable the sandbox budget: the time limit must stop the hang
        PYTHONPATH=f"{REPO}:{REPO / 'platform'}",
    )
    proc = subprocess.Popen(
        # solo: the worker enforces the limits itself (inference.workers.render_limits; D-296)
        [sys.executable, "-m", "celery", "-A", "tests.renderer.render_worker_app", "worker", "-P", request.param,
         "-c", "1", "-Q", queue, "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "warning"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    from tests.renderer.render_worker_app import app

    yield app, queue
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _call(app, queue, name, payload, timeout=30):
    return app.send_task(name, args=[payload], queue=queue).get(timeout=timeout)


def test_real_worker_renders_and_abandons_hanging_template(worker):
    app, queue = worker
    d = tok_dir("qwen3")
    # Warm the pool child (tokenizer load ~0.5 s) under the short limit; a busy CI box may need retries: a load
    # that outlasts the soft limit comes back as the task's SoftTimeLimitExceeded (returned here, not raised)
    for _ in range(5):
        warm = app.send_task("inference.tokenize_prompt", args=[{"tokenizer_dir": d, "prompt": "x"}],
                             queue=queue).get(timeout=60, propagate=False)
        if isinstance(warm, dict) and warm.get("ok"):
            break
    ok = _call(app, queue, "inference.render_chat", {"tokenizer_dir": d, "messages": BASIC}, timeout=60)
    assert ok["ok"] is True, ok
    assert ok["prompt_token_ids"] == render_chat(d, BASIC).prompt_token_ids

    # the template never ends on its own: any answer at all means the time limit (1.5 s) stopped it
    hung = _call(app, queue, "inference.render_chat", {"tokenizer_dir": d, "messages": BASIC, "chat_template": HANG},
                 timeout=120)
    assert hung["ok"] is False and hung["error"]["type"] == "TemplateTimeoutError", hung

    # The worker still serves after the timeout.
    again = _call(app, queue, "inference.tokenize_prompt", {"tokenizer_dir": d, "prompt": "Hello"})
    assert again == {"ok": True, "prompt_token_ids": [9707]}


def test_data_plane_modules_import_without_django_torch_transformers():
    code = (
        "import sys, inference.renderer.chat_template, inference.api.output_processor\n"
        "from inference.renderer.chat_template import render_chat\n"
        f"render_chat({tok_dir('qwen3')!r}, [{{'role': 'user', 'content': 'x'}}])\n"
        "bad = [m for m in ('django', 'torch', 'transformers', 'celery') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "import inference.workers.tasks\n"
        # kombu.utils.json imports django.utils.functional when Django is installed; that is all.
        "bad = [m for m in ('django.conf', 'django.db', 'torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("DJANGO_SETTINGS_MODULE", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_render_chat_leaves_the_prompt_text_out_when_asked():
    """The gateway's payload sets ``return_prompt_text: False`` (it reads only the ids): the reply then carries the
    same ids and not the rendered text, which would add the whole prompt to every reply's bytes."""
    payload = {"tokenizer_dir": tok_dir("qwen3"), "messages": [{"role": "user", "content": "Hello there " * 50}]}
    full = run_render_chat(payload)
    lean = run_render_chat({**payload, "return_prompt_text": False})
    assert full["ok"] and lean["ok"] and "prompt_text" in full and "prompt_text" not in lean
    assert lean["prompt_token_ids"] == full["prompt_token_ids"] == render_chat(
        tok_dir("qwen3"), payload["messages"]).prompt_token_ids
