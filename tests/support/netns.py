"""Several "machines" on this one: Linux network namespaces, each with its own address on a bridge the test makes.

``Lan`` creates a bridge ``llb<tag>`` in this (the root) namespace holding ``10.<a>.<b>.1/24``, and a ``Host`` per
machine: a network namespace ``llmp<tag>-<name>`` whose only interfaces are its loopback and one end of a veth pair,
the other end on the bridge, with ``10.<a>.<b>.<n>/24``. A host has no default route: its processes reach the other
hosts (and the test, on ``.1``) and nothing else. Processes started on a host (``Host.start``) run under
``ip netns exec`` (which ``exec``\\ s: the child's pid is the program's) in a session of their own, so ``Host.kill``
takes the whole process group, as a machine's crash would. File systems and the pid namespace are shared (a
namespace is not a container): each host still gets its own ``var/`` folder.

Needs root (``CAP_NET_ADMIN``) and ``ip``; ``Lan.unavailable()`` says why not, for a clear skip. ``Lan.down``
kills what the hosts still run (``ip netns pids``: every process in the namespace, whichever group it is in), deletes
the namespaces (their veth ends go with them) and the bridge.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

# 10.213.x.0/24 with a random x: two runs at once (other helpers, CI shards) pick different subnets most of the time;
# a clash is refused by the bridge address check in ``Lan.up``.
NET_A = 213


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


def _used_subnets() -> set[int]:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    used = set()
    for word in out.split():
        if word.startswith(f"10.{NET_A}."):
            used.add(int(word.split(".")[2]))
    return used


@dataclass
class Proc:
    """One process on a host: its ``Popen`` (its pid is the program's) and log file."""

    name: str
    popen: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class Host:
    """One machine: a network namespace ``ns`` with address ``addr`` on the bridge; ``procs`` it runs."""

    name: str
    ns: str
    addr: str
    log_dir: Path
    procs: dict[str, Proc] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], *, env: dict[str, str], cwd: Path | None = None,
              user: str | None = None) -> Proc:
        """Start ``argv`` on this host (``ip netns exec``; as ``user`` through ``runuser`` when given) with ``env``,
        output to ``log_dir/<host>-<name>.log``, in a new session (its own process group)."""
        log_path = self.log_dir / f"{self.name}-{name}.log"
        prefix = ["ip", "netns", "exec", self.ns] + (["runuser", "-u", user, "--"] if user else [])
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(prefix + argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        proc = self.procs[name] = Proc(name, popen, log_path)
        return proc

    def run(self, argv: list[str], *, env: dict[str, str] | None = None, user: str | None = None,
            timeout: float = 120) -> str:
        """Run ``argv`` on this host to its end; its stdout. ``CalledProcessError`` when it fails."""
        prefix = ["ip", "netns", "exec", self.ns] + (["runuser", "-u", user, "--"] if user else [])
        out = subprocess.run(prefix + argv, env=env, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise subprocess.CalledProcessError(out.returncode, argv, out.stdout, out.stderr)
        return out.stdout

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to process ``name``'s whole group (a machine losing the process and its children); its pid."""
        proc = self.procs[name]
        try:
            os.killpg(proc.popen.pid, sig)
        except ProcessLookupError:
            pass
        return proc.popen.pid

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to every live process group this host started."""
        for proc in self.procs.values():
            if proc.alive():
                try:
                    os.killpg(proc.popen.pid, sig)
                except ProcessLookupError:
                    pass

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every process group this host started, SIGKILL what is left after ``grace_s``."""
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.popen.pid, signal.SIGKILL)  # the group too: children that outlived their leader
            except ProcessLookupError:
                pass
            try:
                proc.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass


class Lan:
    """A bridge and the hosts on it (module docstring). Use as a context manager, or ``up()`` / ``down()``."""

    def __init__(self, log_dir: Path) -> None:
        self.tag = uuid.uuid4().hex[:5]
        self.bridge = f"llb{self.tag}"
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.subnet_b = 0
        self.hosts: dict[str, Host] = {}

    @staticmethod
    def unavailable() -> str | None:
        """Why this machine cannot make namespaces (a skip reason), or ``None`` when it can: root, ``ip`` present,
        and a probe namespace can be added and deleted."""
        if os.geteuid() != 0:
            return "needs root (network namespaces, veth, bridge)"
        if shutil.which("ip") is None:
            return "the ip command (iproute2) is not installed"
        probe = f"llmpprobe{uuid.uuid4().hex[:6]}"
        try:
            _ip("netns", "add", probe)
            _ip("link", "set", "lo", "up", ns=probe)
        except (subprocess.CalledProcessError, OSError) as exc:
            err = getattr(exc, "stderr", b"") or b""
            return f"ip netns is not permitted here: {err.decode(errors='replace').strip() or exc}"
        finally:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
        return None

    @property
    def gateway(self) -> str:
        """This (the root) namespace's address on the bridge: where the test itself talks from."""
        return f"10.{NET_A}.{self.subnet_b}.1"

    def up(self) -> Lan:
        """Create the bridge with a free 10.213.x.0/24 and its ``.1`` address."""
        used = _used_subnets()
        choices = [b for b in range(2, 255) if b not in used]
        self.subnet_b = random.choice(choices)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        return self

    def host(self, name: str, n: int) -> Host:
        """Add host ``name`` with address ``10.213.x.n`` (``2 <= n <= 254``)."""
        assert 2 <= n <= 254 and name not in self.hosts
        ns = f"llmp{self.tag}-{name}"
        addr = f"10.{NET_A}.{self.subnet_b}.{n}"
        outside, inside = f"lv{self.tag}o{n}", f"lv{self.tag}i{n}"
        _ip("netns", "add", ns)
        host = self.hosts[name] = Host(name, ns, addr, self.log_dir)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        _ip("link", "set", "lo", "up", ns=ns)
        _ip("addr", "add", f"{addr}/24", "dev", inside, ns=ns)
        _ip("link", "set", inside, "up", ns=ns)
        return host

    def down(self) -> None:
        """Stop every host's processes, delete the namespaces and the bridge (best effort, never raises)."""
        for host in self.hosts.values():
            try:
                host.stop_all()
            except Exception:  # noqa: BLE001 - teardown goes on
                pass
        for host in self.hosts.values():
            # whatever still runs in the namespace (a child that left its group, a server's forked process) was
            # started there by this test: SIGKILL it, or the namespace would outlive its deletion with it
            out = subprocess.run(["ip", "netns", "pids", host.ns], capture_output=True, text=True, timeout=20)
            for pid in out.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=20)

    def __enter__(self) -> Lan:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()
