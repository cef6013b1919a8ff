"""The platform as several machines (deploy/README.md, "Many machines"), each a network namespace on a bridge of the
test's own (``tests/support/netns.py``), started with the same commands and environment the deployment files use.

Hosts and addresses (``10.213.x.n``; the test itself talks from ``.1``):

========  ===  ====================================================================================================
redis      2   ``redis-server`` with a password, bound to its address (and its own loopback)
db         3   a private PostgreSQL cluster (``initdb`` in a temporary folder as ``postgres``, trust for the subnet)
api1      11   ``uvicorn config.asgi:application`` (one process: deploy/'s api process type)
api2      12   ``manage.py serve --no-engine``: a render-only frontend machine (its own api, render, usage and
               image workers and beat, on the shared Redis and database)
worker    21   Celery ``render`` worker (``CELERY_REDELIVER_AFTER_S=6``), ``usage`` worker, beat
engine1   31   ``python -m inference.engine`` for the demo model
engine2   32   a second replica of the same model
========  ===  ====================================================================================================

Every process gets the shared environment (``REDIS_URL``, ``DATABASE_URL``, ``DJANGO_SECRET_KEY``,
``API_KEY_PEPPER``, ``DJANGO_ALLOWED_HOSTS``, ``LINK_PREFIX``) and a ``var/`` folder of its host's own; nothing
reaches this machine's own Redis or PostgreSQL. The database is prepared from the test's namespace (migrate, the demo
model, keys, an admission policy) in one ``manage.py shell`` run.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from inference.api import admission as adm
from inference.protocol.engine import (HEARTBEAT_TTL_S, REPLICAS_INDEX_TTL_MS, EngineStats, replica_pattern,
                                       replicas_index_key)
from harness.assets import DEMO_MODEL, MODEL_DIR, ensure_demo_assets
from harness import REPO
from ops.supervisor import wait_until
from harness.drills import count_by_client_id, pg_bin
from tests.support.netns import NET_A, Host, Lan

API_HOSTS = ("api1", "api2")
ENGINE_HOSTS = ("engine1", "engine2")
ADMISSION_LIMIT = 3  # the demo model's max_num_queued_reqs while the admission test runs
KEY_RPM = 3  # the rpm key's requests per minute
KEY_CONCURRENCY = 1000  # the main key's concurrency limit: never reached, but every request takes a lease
MAX_MODEL_LEN = 512
# variables the test's own environment may hold that would point a host at this machine's servers
_OWN_SERVERS = ("REDIS_URL", "DATABASE_URL", "EMBEDDED_REDIS_PORT", "DATABASE_TEST_NAME", "DJANGO_DEBUG")


def unavailable() -> str | None:
    """Why the many-hosts platform cannot run here (a skip reason), or ``None``."""
    why = Lan.unavailable()
    if why:
        return why
    if shutil.which("redis-server") is None:
        return "redis-server is not installed"
    if pg_bin() is None:
        return "PostgreSQL server binaries (initdb, pg_ctl) are not installed"
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "no postgres user to run a private PostgreSQL cluster as"
    return None


@dataclass
class MultiHost:
    """Handles to the running hosts (module docstring)."""

    lan: Lan
    tmp: Path
    pg_dir: Path
    env: dict[str, str]
    prefix: str
    redis_url: str
    database_url: str
    keys: dict[str, str] = field(default_factory=dict)  # role → secret
    key_ids: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def hosts(self) -> dict[str, Host]:
        return self.lan.hosts

    def base(self, host: str) -> str:
        return f"http://{self.hosts[host].addr}:8000"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, socket_timeout=5)

    def manage(self, *args: str, timeout: float = 300) -> str:
        """``manage.py ARGS`` from the test's namespace against the hosts' database and Redis; its stdout."""
        out = subprocess.run([sys.executable, str(REPO / "manage.py"), *args], env=self.host_env("control"),
                             cwd=REPO, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"manage.py {args[0]} failed: {out.stderr[-3000:]}")
        return out.stdout

    def host_env(self, host: str, **extra: str) -> dict[str, str]:
        """The shared environment plus ``host``'s own ``var/`` folder and ``extra``."""
        var = self.tmp / "hosts" / host / "var"
        var.mkdir(parents=True, exist_ok=True)
        return {**self.env, "LLMP_VAR_DIR": str(var), **extra}

    def replicas_alive(self) -> int:
        """Engine replicas of the demo model whose heartbeat is current."""
        r = self.client()
        try:
            return len(r.zrangebyscore(replicas_index_key(self.prefix, DEMO_MODEL), int(time.time() * 1000), "+inf"))
        finally:
            r.close()

    def engine_load(self) -> int:
        """Sequences running or waiting in the live engine replicas of the demo model (their heartbeats)."""
        r = self.client()
        try:
            keys = list(r.scan_iter(match=replica_pattern(self.prefix, DEMO_MODEL)))
            stats = [EngineStats.from_wire(v) for v in r.mget(keys) if v] if keys else []
            return sum(s.num_running + s.num_waiting for s in stats)
        finally:
            r.close()

    def held(self, key_role: str = "main") -> tuple[int, int]:
        """``(admission reservations of the demo model, live key-limit leases of the key of ``key_role``)``."""
        r = self.client()
        try:
            reqs = adm.model_snapshot(r, self.prefix, DEMO_MODEL)["queued_reqs"]
            sec, usec = r.time()
            leases = r.zcount(f"{self.prefix}:lim:k:{self.key_ids[key_role]}:conc",
                              int(sec) * 1000 + int(usec) // 1000, "+inf")
            return int(reqs), int(leases)
        finally:
            r.close()

    def usage_counts(self, marker: str) -> dict[str, int]:
        """``UsageRecord`` rows per ``request_id`` among those containing ``marker``."""
        import psycopg

        with psycopg.connect(self.database_url, connect_timeout=5) as conn:
            rows = conn.execute("SELECT request_id FROM usage_usagerecord WHERE request_id LIKE %s",
                                (f"%{marker}%",)).fetchall()
        return count_by_client_id([rid for (rid,) in rows], marker)

    def serves(self, host: str) -> bool:
        """One short chat through ``host`` answers 200."""
        try:
            r = httpx.post(f"{self.base(host)}/v1/chat/completions", timeout=20,
                           headers={"Authorization": f"Bearer {self.keys['main']}"},
                           json={"model": DEMO_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            return r.status_code == 200
        except httpx.HTTPError:
            return False


# ------------------------------------------------------------------------------------------------ start / stop
_SETUP = """
import io, json
from django.core.management import call_command
from admission.models import AdmissionPolicy
from registry.models import ServedModel
from tenancy.models import ApiKey
from tenancy.selectors import api_key_authenticate

call_command("migrate", interactive=False, verbosity=0)
call_command("register_model", {model!r}, {model_dir!r}, "--max-model-len", "{max_len}", stdout=io.StringIO())

def key(tenant, scopes=None, **fields):
    out = io.StringIO()
    call_command("create_api_key", "--tenant", tenant, "--name", "k", *(["--scopes", scopes] if scopes else []),
                 stdout=out)
    secret = out.getvalue().strip().splitlines()[-1].strip()
    k = ApiKey.objects.get(pk=api_key_authenticate(secret).key_id)
    for name, value in fields.items():
        setattr(k, name, value)
    k.save()
    return secret, k.pk

keys = {{"main": key("mh", max_concurrent_requests={conc}), "rpm": key("mh-rpm", rpm_limit={rpm}),
         "writer": key("mh-writer", scopes="inference,keys:write"), "operator": key("mh-ops", scopes="operator")}}
AdmissionPolicy.objects.create(served_model=ServedModel.objects.get(served_model_name={model!r}),
                               max_num_queued_reqs={limit})
print("KEYS " + json.dumps(keys))
"""


def _start_redis(lan: Lan, plat_tmp: Path, password: str) -> None:
    """Redis on host ``redis``: its address and loopback, port 6379, ``password`` required, nothing saved."""
    redis_host = lan.hosts["redis"]
    conf = plat_tmp / "redis.conf"
    conf.write_text(f"bind {redis_host.addr} 127.0.0.1\nport 6379\nrequirepass {password}\nsave \"\"\n"
                    f"appendonly no\nprotected-mode no\ndir {plat_tmp}\n")
    conf.chmod(0o600)
    redis_host.start("redis", [shutil.which("redis-server") or "redis-server", str(conf)], env=dict(os.environ))


def _start_postgres(lan: Lan, pg_dir: Path) -> None:
    """A private PostgreSQL cluster in ``pg_dir`` on host ``db`` (its address, port 5432, trust for the subnet)
    with an empty ``llmp`` database."""
    db_host = lan.hosts["db"]
    pw = pwd.getpwnam("postgres")
    os.chown(pg_dir, pw.pw_uid, pw.pw_gid)
    bin_dir = pg_bin()
    assert bin_dir is not None
    data = pg_dir / "data"
    db_host.run([str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"],
                user="postgres")
    hba = data / "pg_hba.conf"
    hba.write_text(hba.read_text() + f"\nhost all all 10.{NET_A}.{lan.subnet_b}.0/24 trust\n")
    db_host.run([str(bin_dir / "pg_ctl"), "-D", str(data), "start", "-w", "-t", "60", "-l", str(pg_dir / "pg.log"),
                 "-o", f"-p 5432 -k {pg_dir} -c listen_addresses={db_host.addr} -c fsync=off "
                       "-c max_connections=200"], user="postgres")
    db_host.run([str(bin_dir / "createdb"), "-h", db_host.addr, "-p", "5432", "-U", "postgres", "llmp"])


def _stop_postgres(lan: Lan, pg_dir: Path) -> None:
    bin_dir = pg_bin()
    if bin_dir is not None and "db" in lan.hosts and (pg_dir / "data").exists():
        try:
            lan.hosts["db"].run([str(bin_dir / "pg_ctl"), "-D", str(pg_dir / "data"), "stop", "-m", "immediate",
                                 "-w", "-t", "30"], user="postgres", timeout=60)
        except (subprocess.SubprocessError, OSError):
            pass
    shutil.rmtree(pg_dir, ignore_errors=True)


def start_engine(plat: MultiHost, host: str) -> None:
    """Start the demo model's engine replica on ``host`` (REDIS_URL from its environment)."""
    plat.hosts[host].start("engine", [sys.executable, "-m", "inference.engine", "--model", DEMO_MODEL,
                                      "--model-dir", str(MODEL_DIR), "--link-prefix", plat.prefix,
                                      "--max-num-seqs", "32", "--max-model-len", str(MAX_MODEL_LEN),
                                      "--num-threads", "1"], env=plat.host_env(host), cwd=REPO)


def start_api(plat: MultiHost, host: str) -> None:
    """Start one uvicorn api process on ``host``:8000, as ``deploy/``'s api process type."""
    plat.hosts[host].start("api", [sys.executable, "-m", "uvicorn", "config.asgi:application", "--app-dir", "platform",
                                   "--host", plat.hosts[host].addr, "--port", "8000", "--no-access-log",
                                   "--timeout-graceful-shutdown", "5"], env=plat.host_env(host), cwd=REPO)


def start_frontend(plat: MultiHost, host: str) -> None:
    """Start a self-contained render-only frontend on ``host``:8000: ``manage.py serve --no-engine`` with the
    shared ``REDIS_URL`` and ``DATABASE_URL`` (its own api, render, usage and image workers and beat; the engines
    are elsewhere), as deploy/README.md's frontend machines run it."""
    plat.hosts[host].start("api", [sys.executable, "manage.py", "serve", "--no-engine", "--host", plat.hosts[host].addr,
                                   "--port", "8000", "--mm-api-workers", "0", "--render-concurrency", "1"],
                           env=plat.host_env(host), cwd=REPO)


def _celery(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "config", "--workdir", "platform", *args]


def start_multihost(tmp: Path) -> MultiHost:
    """Make the LAN and its hosts, start every process, prepare the database; return once both api hosts serve a
    chat and both engine replicas beat. The caller ends it with ``stop_multihost``."""
    ensure_demo_assets()
    t0 = time.monotonic()
    lan = Lan(tmp / "log").up()
    pg_dir = Path("/nonexistent")
    plat: MultiHost | None = None
    try:
        for name, n in (("redis", 2), ("db", 3), ("api1", 11), ("api2", 12), ("worker", 21), ("engine1", 31),
                        ("engine2", 32)):
            lan.host(name, n)
        password = uuid.uuid4().hex
        _start_redis(lan, tmp, password)
        pg_dir = Path(tempfile.mkdtemp(prefix="llmp-mh-pg-"))
        prefix = f"mh{uuid.uuid4().hex[:8]}"
        redis_url = f"redis://:{password}@{lan.hosts['redis'].addr}:6379/0"
        database_url = f"postgres://postgres@{lan.hosts['db'].addr}:5432/llmp"
        env = {k: v for k, v in os.environ.items() if k not in _OWN_SERVERS}
        env.update({"REDIS_URL": redis_url, "DATABASE_URL": database_url, "LINK_PREFIX": prefix,
                    "DJANGO_SECRET_KEY": uuid.uuid4().hex * 2, "API_KEY_PEPPER": uuid.uuid4().hex * 2,
                    "DJANGO_ALLOWED_HOSTS": ",".join(lan.hosts[h].addr for h in API_HOSTS),
                    "DJANGO_SETTINGS_MODULE": "config.settings", "LOG_LEVEL": "WARNING",
                    "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)])})
        plat = MultiHost(lan=lan, tmp=tmp, pg_dir=pg_dir, env=env, prefix=prefix, redis_url=redis_url,
                         database_url=database_url)
        wait_until(lambda: _ping(plat), 20, "the redis host")
        for host in ENGINE_HOSTS:  # they load the model while the database is made and prepared
            start_engine(plat, host)
        _start_postgres(lan, pg_dir)
        plat.timings["servers_s"] = time.monotonic() - t0
        out = plat.manage("shell", "-c", _SETUP.format(model=DEMO_MODEL, model_dir=str(MODEL_DIR),
                                                       max_len=MAX_MODEL_LEN, conc=KEY_CONCURRENCY, rpm=KEY_RPM,
                                                       limit=ADMISSION_LIMIT))
        keys = json.loads(out.split("KEYS ", 1)[1].splitlines()[0])
        plat.keys = {role: secret for role, (secret, _pk) in keys.items()}
        plat.key_ids = {role: pk for role, (_secret, pk) in keys.items()}
        plat.timings["database_s"] = time.monotonic() - t0
        worker = plat.hosts["worker"]
        worker.start("render", _celery("worker", "-Q", "render", "-c", "1", "--pool", "prefork", "-n",
                                       f"render-{prefix}@%h", "--without-gossip", "--without-mingle", "-l", "WARNING"),
                     env=plat.host_env("worker", CELERY_REDELIVER_AFTER_S="6"), cwd=REPO)
        worker.start("usage", _celery("worker", "-Q", "usage", "-c", "1", "--pool", "prefork", "-n",
                                      f"usage-{prefix}@%h", "--without-gossip", "--without-mingle", "-l", "WARNING"),
                     env=plat.host_env("worker"), cwd=REPO)
        worker.start("beat", _celery("beat", "-l", "WARNING", "--schedule",
                                     str(tmp / "hosts" / "worker" / "var" / "beat-schedule")),
                     env=plat.host_env("worker"), cwd=REPO)
        start_api(plat, "api1")  # the api process type alone; the render workers are on the worker host
        start_frontend(plat, "api2")  # a whole frontend machine: manage.py serve --no-engine
        _wait(plat, lambda: plat.replicas_alive() >= len(ENGINE_HOSTS), 240, "both engine replicas")
        for host in API_HOSTS:
            _wait(plat, lambda host=host: plat.serves(host), 240, f"{host} to serve a chat")
        plat.timings["ready_s"] = time.monotonic() - t0
        return plat
    except BaseException:
        if plat is not None:
            stop_multihost(plat)
        else:
            _stop_postgres(lan, pg_dir)
            lan.down()
        raise


def stop_multihost(plat: MultiHost) -> None:
    """Stop every host's processes, PostgreSQL, delete the namespaces and the bridge."""
    try:
        # the processes first, all at once, then the servers they use (so none of them spends its grace period
        # retrying a Redis that is gone)
        app_hosts = [h for name, h in plat.hosts.items() if name not in ("redis", "db")]
        for host in app_hosts:
            host.signal_all(signal.SIGTERM)
        for host in app_hosts:
            host.stop_all(grace_s=3.0)
        _stop_postgres(plat.lan, plat.pg_dir)
    finally:
        plat.lan.down()


def _ping(plat: MultiHost) -> bool:
    try:
        return bool(plat.client().ping())
    except redis.RedisError:
        return False


def _wait(plat: MultiHost, predicate, timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 0.2 s until true; ``RuntimeError`` after ``timeout_s``, or at once (with the end of
    its log) when a process a host started has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        for host in plat.hosts.values():
            for proc in host.procs.values():
                if not proc.alive():
                    raise RuntimeError(f"{host.name}/{proc.name} exited with {proc.popen.returncode} while waiting "
                                       f"for {what}:\n{proc.log_tail()}")
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")


# ------------------------------------------------------------------------------------------------ faults
@contextmanager
def engines_paused(plat: MultiHost) -> Iterator[None]:
    """SIGSTOP every engine replica's process group: admitted requests get no first token until the block ends
    (SIGCONT). Their heartbeats are held meanwhile (key TTL, index score and index expiry 120 s ahead), then set back to what an
    engine's own beat sets, as ``tests/support/live.py:engine_paused`` does for one replica."""
    r = plat.client()
    keys = list(r.scan_iter(match=replica_pattern(plat.prefix, DEMO_MODEL)))
    index = replicas_index_key(plat.prefix, DEMO_MODEL)
    members = r.zrange(index, 0, -1)
    pids = [plat.hosts[h].procs["engine"].popen.pid for h in ENGINE_HOSTS if plat.hosts[h].procs["engine"].alive()]
    for pid in pids:
        os.killpg(pid, signal.SIGSTOP)
    try:
        for key in keys:
            r.pexpire(key, 120_000)
        if members:
            r.zadd(index, {m: int(time.time() * 1000) + 120_000 for m in members})
            r.pexpire(index, 120_000 + REPLICAS_INDEX_TTL_MS)
        yield
    finally:
        ttl_ms = int(HEARTBEAT_TTL_S * 1000)
        for key in keys:
            r.pexpire(key, ttl_ms)
        if members:
            r.zadd(index, {m: int(time.time() * 1000) + ttl_ms for m in members})
            r.pexpire(index, REPLICAS_INDEX_TTL_MS)
        for pid in pids:
            os.killpg(pid, signal.SIGCONT)
        r.close()
