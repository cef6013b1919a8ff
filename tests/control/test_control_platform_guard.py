"""``platform/`` is a source folder, never a package: the standard library's ``platform`` must win."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[2]


def test_platform_is_the_stdlib_module():
    import platform

    assert platform.system()  # e.g. "Linux"
    assert Path(platform.__file__).resolve().parent == Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert not (REPO_DIR / "platform" / "__init__.py").exists()


def test_manage_py_sets_up_path_and_migrations_are_current():
    """manage.py runs from another cwd, finds config.settings, and the control apps' migrations are current."""
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    result = subprocess.run(
        [sys.executable, str(REPO_DIR / "manage.py"), "makemigrations", "registry", "tenancy", "usage",
         "--check", "--dry-run", "--skip-checks"],
        cwd="/", env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No changes detected" in result.stdout


def test_celery_app_config():
    """The Celery app reads CELERY_* settings: routes, prefetch, beat schedule, acks_late on usage and render tasks,
    the render workers' heartbeat."""
    from config import celery_app

    conf = celery_app.conf
    assert conf.worker_prefetch_multiplier == 8  # render tasks are small and many (settings.py)
    assert conf.beat_schedule["usage-flush-usage-events"]["task"] == "usage.flush_usage_events"
    assert conf.beat_schedule["usage-flush-usage-events"]["schedule"] == 1.0
    router = celery_app.amqp.router
    assert router.route({}, "inference.render_chat")["queue"].name == "render"
    assert router.route({}, "inference.tokenize_prompt")["queue"].name == "render"
    assert router.route({}, "inference.detokenize")["queue"].name == "render"
    assert router.route({}, "inference.mm_preprocess")["queue"].name == "mm"
    assert router.route({}, "usage.flush_usage_events")["queue"].name == "usage"
    from usage.tasks import flush_usage_events

    assert flush_usage_events.acks_late is True
    from config.celery import RenderHeartbeat
    from inference.workers.tasks import detokenize_task, render_chat_task, tokenize_prompt_task

    for task in (render_chat_task, tokenize_prompt_task, detokenize_task):  # handed back if the worker dies (D-190)
        assert task.acks_late is True and not task.reject_on_worker_lost
    assert RenderHeartbeat in celery_app.steps["consumer"]  # render workers beat (D-191)
    import importlib.util

    if importlib.util.find_spec("inference.workers.tasks") is not None:
        assert "inference.workers.tasks" in conf.include
