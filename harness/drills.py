"""Fault drills (issue 17): ``manage.py serve`` on a private Redis, one process killed during a burst of mixed
streaming and non-streaming chats, and what the platform held afterwards. Shared by ``tests/failures/test_drills.py``
(which asserts the goals) and ``bench/drills.py`` (which prints the table).

The platform: a ``redis-server`` of its own on a free loopback port (append-only file in the drill's folder, so a
restart keeps its data; the machine's shared Redis is never touched), SQLite in the drill's ``var/`` (or, with
``postgres=True``, a private PostgreSQL cluster, ``PrivatePostgres``), the demo model, one API key with a concurrency
limit (so every request holds a key-limit lease), and ``manage.py serve --mm-api-workers 0`` (one api process: after
its ``kill -9`` no other api is left to reap, the strict case).

A drill (``run_drill``): ``requests`` chats, alternately streamed and not, sent ``spread_s`` apart in all over about
two seconds, the victim killed (or Redis / PostgreSQL restarted, or the engine stopped with SIGSTOP and never
continued: ``engine-hang``, which ``serve`` ends once its heartbeat has lapsed ``ENGINE_UNRESPONSIVE_S``, then
restarts) ``kill_after_s`` after the first; every request has a
deadline (``HANG_S``) past which it counts as hung. Then, ``SETTLE_S`` after the kill or after the last request ended
(whichever is later): admission reservations (``queued_reqs`` of the model) and live key-limit leases of the key,
both goal 0. Usage is counted at the end of all drills (``usage_check``): every request answered (a full response,
an error envelope or an in-band error) must have exactly one ``UsageRecord`` (lost: none; doubled: more than one),
matched by the ``X-Request-Id`` each request sends. Requests cut off with the process that held them (an api
``kill -9``) cannot have one and are not counted as lost; they are reported as ``cut``.

Outcomes of a request: ``ok`` (complete), ``error`` (an HTTP error with the OpenAI envelope, or a stream that ended
with an in-band error event), ``closed`` (the connection closed or refused: the api was gone), ``hung`` (no end
within ``HANG_S``), ``unclean`` (anything else: a body that is not the envelope, a stream cut without an error while
the api lived).
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from inference.api import admission as adm
from harness import REPO
from harness.assets import DEMO_MODEL, MODEL_DIR, ensure_demo_assets
from harness.live_platform import free_port, run_manage
from harness.serve import child_pids, cmdline, serve_banner, serve_env, stop_serve
from ops.supervisor import wait_until

HANG_S = 45.0  # a request with no end after this long is hung (the render wait is 20 s, an engine's heartbeat 3 s)
SETTLE_S = 10.0  # what may still be held this long after the fault (issue 17's goal: nothing)
BACK_WITHIN_S = 180.0  # the killed process's replacement serves again within this (Django/torch start-up, busy box)
KEY_CONCURRENCY = 1000  # the drill key's concurrency limit: never reached, but every request takes a lease
VICTIMS = ("api", "render-worker", "engine", "usage-worker", "beat")
HANGS = ("engine-hang",)  # a victim stopped (SIGSTOP of its process group), never continued: serve must end it
ENGINE_UNRESPONSIVE_S = 10.0  # the drill platform's ``serve --engine-unresponsive-s``
RESTARTS = ("redis-restart", "postgres-restart")


# ------------------------------------------------------------------------------------------------ private servers
class PrivateRedis:
    """A ``redis-server`` on a free loopback port, data in ``dir_`` (append-only file, fsync every second), so a
    restart keeps its keys. ``restart()``: SIGTERM (Redis saves and exits, as a service restart does), then start
    again on the same port; returns the seconds it was unreachable for."""

    def __init__(self, dir_: Path):
        self.dir = dir_
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the server; wait until it answers PING (20 s)."""
        exe = shutil.which("redis-server")
        assert exe, "redis-server is not installed"
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                                      "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                                      "--protected-mode", "yes", "--logfile", str(self.dir / "redis.log")],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        wait_until(lambda: _ping(client), 20, "the private redis-server")

    def stop(self) -> None:
        """SIGTERM and wait (10 s), then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> float:
        """Stop (saving) and start again on the same port; the seconds it did not answer."""
        t0 = time.monotonic()
        self.stop()
        self.start()
        return time.monotonic() - t0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


def _ping(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


class PrivatePostgres:
    """A PostgreSQL cluster of its own (``initdb`` in a new temporary folder as the ``postgres`` user, trust auth,
    loopback on a free port, its socket in that folder): the machine's PostgreSQL is never touched. ``available()`` says whether this
    machine can make one (the binaries, running as root to switch to ``postgres``). ``restart()``: a fast shutdown
    and start (``pg_ctl restart -m fast``, as a service restart); returns the seconds it took."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="llmp-drill-pg-"))  # 0700, then the postgres user's alone
        self.data = self.dir / "data"
        self.port = free_port()
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/drills"
        self.bin = pg_bin()

    @staticmethod
    def available() -> bool:
        """True when ``initdb`` and ``pg_ctl`` are installed, a ``postgres`` user exists and this runs as root."""
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return False
        return os.geteuid() == 0 and pg_bin() is not None

    def _as_postgres(self, *argv: str, timeout: float = 120) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *argv], check=True, timeout=timeout,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self) -> None:
        """``initdb`` (first time), start the server, create the ``drills`` database."""
        assert self.bin is not None
        first = not self.data.exists()
        pw = pwd.getpwnam("postgres")
        os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        if first:
            self._as_postgres(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                              "--no-sync")
        self._pg_ctl("start", "-w", "-t", "60", "-l", str(self.dir / "pg.log"), "-o",
                     f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off")
        if first:
            self._as_postgres(str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "drills")

    def _pg_ctl(self, *args: str) -> None:
        assert self.bin is not None
        self._as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.data), *args)

    def restart(self) -> float:
        """A fast restart; the seconds it took."""
        t0 = time.monotonic()
        self._pg_ctl("restart", "-m", "fast", "-w", "-t", "60", "-l", str(self.dir / "pg.log"), "-o",
                     f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off")
        return time.monotonic() - t0

    def stop(self) -> None:
        """An immediate shutdown and its folder removed (best effort)."""
        try:
            self._pg_ctl("stop", "-m", "immediate", "-w", "-t", "30")
        except (subprocess.SubprocessError, OSError):
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


def pg_bin() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding ``initdb`` and ``pg_ctl``; None when there is none."""
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (candidate / "initdb").is_file() and (candidate / "pg_ctl").is_file():
            return candidate
    return None


# ------------------------------------------------------------------------------------------------ the platform
@dataclass
class DrillPlatform:
    """A ``manage.py serve`` for drills and its private servers (``start_drill_platform``)."""

    proc: subprocess.Popen
    base: str
    port: int
    key: str
    key_id: int
    env: dict
    var_dir: Path
    redis: PrivateRedis
    postgres: PrivatePostgres | None
    prefix: str
    log: list[str] = field(default_factory=list)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis.url, socket_timeout=5)

    def children(self) -> dict[int, str]:
        """serve's children: pid → command line."""
        return {pid: cmdline(pid) for pid in child_pids(self.proc.pid)}

    def victim(self, role: str) -> int:
        """The pid of the process playing ``role`` (one of ``VICTIMS`` or ``HANGS``; of the render workers, the
        first)."""
        found = self.playing(role)
        assert len(found) == 1 or (role == "render-worker" and found), (role, self.children())
        return found[0]

    def playing(self, role: str) -> list[int]:
        """The pids of serve's children playing ``role`` (one of ``VICTIMS``; ``serve`` runs two render workers),
        lowest first."""
        marks = {"api": ("uvicorn", f"--port {self.port} "), "render-worker": ("celery", "-Q render"),
                 "engine": ("inference.engine",), "engine-hang": ("inference.engine",),
                 "usage-worker": ("celery", "-Q usage"), "beat": ("celery", "config beat")}[role]
        return sorted(pid for pid, cmd in self.children().items() if all(m in cmd + " " for m in marks))

    def held(self) -> tuple[int, int]:
        """``(admission reservations of the model, live key-limit leases of the drill key)``."""
        r = self.client()
        try:
            reqs = adm.model_snapshot(r, self.prefix, DEMO_MODEL)["queued_reqs"]
            sec, usec = r.time()
            leases = r.zcount(f"{self.prefix}:lim:k:{self.key_id}:conc", int(sec) * 1000 + int(usec) // 1000, "+inf")
            return int(reqs), int(leases)
        finally:
            r.close()

    def usage_counts(self, marker: str) -> dict[str, int]:
        """``UsageRecord`` rows whose ``request_id`` contains ``marker``, counted per client request id (the part
        from ``marker`` to the first ``~``, which ends every drill request's id)."""
        if self.postgres is not None:
            import psycopg

            with psycopg.connect(self.postgres.url) as conn:
                rows = conn.execute("SELECT request_id FROM usage_usagerecord WHERE request_id LIKE %s",
                                    (f"%{marker}%",)).fetchall()
        else:
            with sqlite3.connect(self.var_dir / "db.sqlite3", timeout=20) as conn:
                rows = conn.execute("SELECT request_id FROM usage_usagerecord WHERE request_id LIKE ?",
                                    (f"%{marker}%",)).fetchall()
        return count_by_client_id([rid for (rid,) in rows], marker)

    def serves(self) -> bool:
        """One short non-streamed chat answers 200 (the api, a render worker and the engine all work)."""
        try:
            r = httpx.post(f"{self.base}/v1/chat/completions", timeout=20, headers=self._auth(),
                           json={"model": DEMO_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def start_drill_platform(tmp: Path, *, postgres: bool = False, serve_args: tuple[str, ...] = ()) -> DrillPlatform:
    """Start the private Redis (and PostgreSQL), prepare the database (migrate, the demo model, a key with a
    concurrency limit) and ``manage.py serve --mm-api-workers 0 --engine-unresponsive-s 10``; return once it printed
    its banner. The caller stops it with ``stop_drill_platform``."""
    ensure_demo_assets()
    (tmp / "var").mkdir(parents=True, exist_ok=True)
    priv = PrivateRedis(tmp / "redis")
    priv.start()
    pg = None
    env = serve_env(tmp / "var")
    env["REDIS_URL"] = priv.url
    env.pop("EMBEDDED_REDIS_PORT", None)
    try:
        if postgres:
            pg = PrivatePostgres()
            pg.start()
            env["DATABASE_URL"] = pg.url
        run_manage(env, "migrate", "--no-input", timeout=300)
        run_manage(env, "register_model", DEMO_MODEL, str(MODEL_DIR), "--max-model-len", "512")
        key = run_manage(env, "create_api_key", "--tenant", "drills", "--name", "k").strip().splitlines()[-1].strip()
        key_id = int(run_manage(env, "shell", "-c", (
            "from tenancy.models import ApiKey; from tenancy.selectors import api_key_authenticate; "
            f"k = ApiKey.objects.get(pk=api_key_authenticate('{key}').key_id); "
            f"k.max_concurrent_requests = {KEY_CONCURRENCY}; k.save(); print(k.pk)")).strip().splitlines()[-1])
        port = free_port()
        proc = subprocess.Popen([sys.executable, str(REPO / "manage.py"), "serve", "--port", str(port),
                                 "--mm-api-workers", "0", "--engine-unresponsive-s", str(ENGINE_UNRESPONSIVE_S),
                                 *serve_args], env=env, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    except BaseException:
        if pg is not None:
            pg.stop()
        priv.stop()
        raise
    plat = DrillPlatform(proc=proc, base=f"http://127.0.0.1:{port}", port=port, key=key, key_id=key_id, env=env,
                         var_dir=tmp / "var", redis=priv, postgres=pg, prefix=env["LINK_PREFIX"])
    try:
        assert proc.stdout is not None
        plat.log.extend(serve_banner(proc.stdout, 600))
        wait_until(plat.serves, BACK_WITHIN_S, "the drill platform to serve")
    except BaseException:
        stop_drill_platform(plat)
        raise
    return plat


def stop_drill_platform(plat: DrillPlatform) -> None:
    """Stop serve (as Ctrl-C), then the private servers."""
    try:
        stop_serve(plat.proc)
    finally:
        if plat.postgres is not None:
            plat.postgres.stop()
        plat.redis.stop()


# ------------------------------------------------------------------------------------------------ one drill
@dataclass
class Outcome:
    """One request's end: ``kind`` (``ok``, ``error``, ``closed``, ``hung``, ``unclean``), seconds from its start to
    its end, ``code`` (the error's code or HTTP status, or the exception's name) and whether it started after the
    fault."""

    client_id: str
    stream: bool
    kind: str
    seconds: float
    code: str = ""
    after_fault: bool = False


@dataclass
class DrillResult:
    """What one drill measured. ``held_reqs`` / ``held_slots``: admission reservations and key-limit leases still
    held ``SETTLE_S`` after the fault (or after the last request ended, if later; read earlier once both are 0); ``back_s``: seconds from the
    fault until the platform served again; ``fault_s``: seconds the fault itself took (a Redis or PostgreSQL restart:
    how long it was down; 0 for a kill); ``lost`` / ``doubled`` / ``cut``: filled in by ``usage_check``."""

    name: str
    outcomes: list[Outcome]
    held_reqs: int
    held_slots: int
    back_s: float
    fault_s: float = 0.0
    lost: int = -1
    doubled: int = -1
    cut: int = 0
    notes: str = ""

    def count(self, kind: str) -> int:
        return sum(1 for o in self.outcomes if o.kind == kind)

    @property
    def marker(self) -> str:
        return f"drill-{self.name}-"

    def row(self) -> dict[str, object]:
        """The drill's row of the table."""
        slowest_ok = max((o.seconds for o in self.outcomes if o.kind == "ok"), default=0.0)
        codes = sorted({o.code for o in self.outcomes if o.kind in ("error", "unclean", "closed") and o.code})
        return {"drill": self.name, "requests": len(self.outcomes), "ok": self.count("ok"),
                "failed cleanly": self.count("error") + self.count("closed"), "hung": self.count("hung"),
                "unclean": self.count("unclean"), "slowest ok s": round(slowest_ok, 1),
                "reservations held": self.held_reqs, "key slots held": self.held_slots,
                "usage lost": self.lost, "usage doubled": self.doubled, "fault s": round(self.fault_s, 1),
                "back s": round(self.back_s, 1), "errors": ",".join(codes)}


def _body(i: int, stream: bool, max_tokens: int) -> dict:
    return {"model": DEMO_MODEL, "stream": stream, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"drill request {i}: tell me a story"}]}


async def _one(http: httpx.AsyncClient, plat: DrillPlatform, client_id: str, i: int, stream: bool, max_tokens: int,
               fault_at: list[float]) -> Outcome:
    return await send_chat(http, plat.base, plat.key, client_id, i, stream, max_tokens, fault_at)


async def send_chat(http: httpx.AsyncClient, base: str, key: str, client_id: str, i: int, stream: bool,
                    max_tokens: int, fault_at: list[float]) -> Outcome:
    """One drill chat (``_body``) to ``base`` with API key ``key`` and ``X-Request-Id: client_id``; its ``Outcome``
    (``after_fault`` when it started after ``fault_at[0]``, if set). Never raises for the request's own failures."""
    t0 = time.monotonic()
    headers = {"Authorization": f"Bearer {key}", "X-Request-Id": client_id}

    def out(kind: str, code: str = "") -> Outcome:
        return Outcome(client_id, stream, kind, time.monotonic() - t0, code,
                       after_fault=bool(fault_at) and t0 >= fault_at[0])

    try:
        async with asyncio.timeout(HANG_S):
            async with http.stream("POST", f"{base}/v1/chat/completions", headers=headers,
                                   json=_body(i, stream, max_tokens)) as resp:
                if resp.status_code != 200:
                    raw = await resp.aread()
                    return out(*_error_kind(raw, resp.status_code))
                if not stream:
                    raw = await resp.aread()
                    data = json.loads(raw)
                    return out("ok") if data.get("choices") else out("unclean", "no choices")
                events: list[str] = []
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                if events and events[-1] == "[DONE]":
                    last = json.loads(events[-2]) if len(events) > 1 else {}
                    if "error" in last:
                        return out("error", str(last["error"].get("code")))
                    return out("ok")
                return out("closed", "stream ended without [DONE]")
    except TimeoutError:
        return out("hung")
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError, httpx.WriteError) as exc:
        return out("closed", type(exc).__name__)
    except httpx.HTTPError as exc:
        return out("unclean", type(exc).__name__)


def _error_kind(raw: bytes, status: int) -> tuple[str, str]:
    """``("error", code)`` for a body in the OpenAI error envelope, else ``("unclean", status)``."""
    try:
        err = json.loads(raw)["error"]
        if isinstance(err.get("message"), str) and "type" in err:
            return "error", str(err.get("code") or status)
    except (ValueError, KeyError, TypeError):
        pass
    return "unclean", str(status)


def _fault(plat: DrillPlatform, name: str) -> tuple[int | None, float]:
    """Do drill ``name``'s fault: ``kill -9`` of a victim, or a restart of Redis / PostgreSQL. Returns the killed
    pid (None for a restart) and the seconds the fault itself took."""
    if name in VICTIMS:
        pid = plat.victim(name)
        os.kill(pid, signal.SIGKILL)
        return pid, 0.0
    if name in HANGS:
        pid = plat.victim(name)
        os.killpg(pid, signal.SIGSTOP)  # its own process group (serve starts each child in a session of its own)
        return pid, 0.0
    if name == "redis-restart":
        return None, plat.redis.restart()
    if name == "postgres-restart":
        assert plat.postgres is not None
        return None, plat.postgres.restart()
    raise ValueError(name)


def _replaced(plat: DrillPlatform, name: str, killed: int | None, count: int) -> bool:
    """The killed process is gone and ``count`` processes play its role again."""
    if killed is None:
        return True
    now = plat.playing(name)
    return killed not in now and len(now) == count


def run_drill(plat: DrillPlatform, name: str, *, requests: int = 12, spread_s: float = 2.0,
              kill_after_s: float | None = None, max_tokens: int = 48) -> DrillResult:
    """One drill (module docstring): ``requests`` chats over ``spread_s`` seconds, the fault ``kill_after_s`` after
    the first (default: a render worker after 0.15 s of a 0.3 s spread, so that it dies with renders fetched and not
    started; anything else 0.6 s, with streams under way), the state ``SETTLE_S`` later, then a wait (``BACK_WITHIN_S``) until the platform serves
    again."""
    if name == "render-worker" and spread_s == 2.0:
        spread_s = 0.3  # a backlog on the worker when it dies: tasks it fetched and had not started
    if kill_after_s is None:
        kill_after_s = 0.15 if name == "render-worker" else 0.6
    fault_at: list[float] = []
    killed: dict[str, object] = {}
    count = len(plat.playing(name)) if name in VICTIMS + HANGS else 0

    async def burst() -> list[Outcome]:
        limits = httpx.Limits(max_connections=requests + 4, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=httpx.Timeout(HANG_S), limits=limits) as http:
            async def later(i: int) -> Outcome:
                await asyncio.sleep(i * spread_s / requests)
                return await _one(http, plat, f"drill-{name}-{i}~", i, i % 2 == 0, max_tokens, fault_at)

            async def fault() -> None:
                await asyncio.sleep(kill_after_s)
                fault_at.append(time.monotonic())
                pid, took = await asyncio.to_thread(_fault, plat, name)
                killed.update(pid=pid, took=took)

            tasks = [asyncio.create_task(later(i)) for i in range(requests)]
            await fault()
            return list(await asyncio.gather(*tasks))

    outcomes = asyncio.run(burst())
    ended = time.monotonic()
    t_fault = fault_at[0]
    # every request has ended and the fault is over: nothing can take a reservation or a slot any more, so what is
    # held only falls; the first zero reading is final, any other is read at the deadline
    settle_at = max(t_fault, ended) + SETTLE_S
    held_reqs, held_slots = plat.held()
    while (held_reqs, held_slots) != (0, 0) and time.monotonic() < settle_at:
        time.sleep(min(0.5, max(0.0, settle_at - time.monotonic())))
        held_reqs, held_slots = plat.held()
    wait_until(lambda: _replaced(plat, name, killed.get("pid"), count) and plat.serves(), BACK_WITHIN_S,
               f"the platform to serve again after {name}")
    result = DrillResult(name=name, outcomes=outcomes, held_reqs=held_reqs, held_slots=held_slots,
                         back_s=time.monotonic() - t_fault, fault_s=float(killed.get("took", 0.0)))
    if name == "api":
        # requests the dead api held, and those sent before its replacement listened, cannot have usage
        result.cut = result.count("closed")
    return result


def count_by_client_id(request_ids: list[str], marker: str) -> dict[str, int]:
    """Usage ``request_id``s counted per client request id: the part from ``marker`` to the first ``~`` after it
    (which ends every drill request's id), or to the end."""
    out: dict[str, int] = {}
    for rid in request_ids:
        start = rid.index(marker)
        end = rid.find("~", start)
        cid = rid[start:end + 1] if end >= 0 else rid[start:]
        out[cid] = out.get(cid, 0) + 1
    return out


def _recordable(o: Outcome) -> bool:
    """Whether a request's end must leave exactly one usage record: an answer (``ok`` or an error envelope), except a
    503 ``database_unavailable``, which is answered while the database (where the key is read) is down."""
    return o.kind in ("ok", "error") and o.code != "database_unavailable"


def usage_check(plat: DrillPlatform, results: list[DrillResult], timeout_s: float = 60.0) -> None:
    """Fill in ``lost`` and ``doubled`` of every drill: each request that got an answer (``ok`` or ``error``) needs
    exactly one usage record. Waits up to ``timeout_s`` for the usage worker to write what is still in the stream
    (entries a killed worker held are claimed again after 30 s, usage/services.py)."""
    answered = {o.client_id for res in results for o in res.outcomes if _recordable(o)}
    deadline = time.monotonic() + timeout_s
    counts: dict[str, int] = {}
    while True:
        counts = plat.usage_counts("drill-")
        if answered <= set(counts) or time.monotonic() > deadline:
            break
        time.sleep(1)
    for res in results:
        mine = [o for o in res.outcomes if _recordable(o)]
        res.lost = sum(1 for o in mine if counts.get(o.client_id, 0) == 0)
        res.doubled = sum(1 for o in res.outcomes if counts.get(o.client_id, 0) > 1)


def table(results: list[DrillResult]) -> str:
    """The drills as a Markdown table."""
    rows = [r.row() for r in results]
    if not rows:
        return ""
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
