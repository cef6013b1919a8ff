"""Issue 39, the deployment files: the api trusts the ingress's proxy headers (items 1), systemd units run as an
unprivileged, sandboxed user (item 4), Kubernetes pods run locked down behind NetworkPolicies (item 6).

Everything here reads ``deploy/`` as the tools would: the manifests ``kustomization.yaml`` lists (and, where
``kubectl`` is installed, ``kubectl kustomize``'s rendering of them), the unit files (and, where systemd's tools are
installed, ``systemd-analyze security --offline`` on each unit and ``systemd-sysusers --root`` on the user file).
That the processes still start with these settings (a writable ``var/``, the refusals at start) is checked by
``test_deploy_start_refusals.py``.
"""

from __future__ import annotations

import configparser
import ipaddress
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
#: addresses an internet-facing fetcher must never reach: private, loopback, link-local (cloud metadata), CGNAT
INTERNAL_NETS = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "127.0.0.0/8",
                                                     "169.254.0.0/16", "100.64.0.0/10", "fc00::/7", "fe80::/10")]


# ------------------------------------------------------------------------------------------------ helpers
def _docs() -> list[dict]:
    """Every manifest document of the resources ``kustomization.yaml`` applies."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def _of_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in _docs() if d["kind"] == kind}


def _pods() -> dict[str, dict]:
    """Pod templates (``metadata`` and ``spec``) of the Deployments and Jobs, by name."""
    return {name: d["spec"]["template"] for kind in ("Deployment", "Job") for name, d in _of_kind(kind).items()}


def _dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text()


def _image_var_dir() -> str:
    """``LLMP_VAR_DIR`` of the image (the Dockerfile's ``ENV``)."""
    return re.search(r"LLMP_VAR_DIR=(\S+)", _dockerfile()).group(1)


def _image_home() -> str:
    """Home directory of the image's unprivileged user (``useradd --home-dir``): where ``~/.cache`` lands."""
    return re.search(r"useradd[^\n]*--home-dir\s+(\S+)", _dockerfile()).group(1)


def _under(path: str, mount: str) -> bool:
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def _unit(path: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # keys are case-sensitive in systemd
    parser.read_string(path.read_text())
    return parser


def _unit_values(path: Path, key: str) -> list[str]:
    """Every value of ``key`` in the unit's ``[Service]`` section (systemd allows a key several times)."""
    return [ln.split("=", 1)[1].strip() for ln in path.read_text().splitlines() if ln.startswith(key + "=")]


# ------------------------------------------------------------------------------------------------ item 1
def test_k8s_ships_no_trusted_proxy_network():
    """Behind the Ingress every request comes from the ingress controller's pods: uvicorn must believe their
    ``X-Forwarded-For`` (``FORWARDED_ALLOW_IPS``), or every client has the ingress's address. Which addresses those
    are depends on the cluster: a pod network (10.0.0.0/8 was shipped) lets any pod spoof any client where the CNI
    does not enforce NetworkPolicy (flannel's 10.244.0.0/16), so the ConfigMap ships none and the api refuses to
    start until the operator lists them (test_deploy_start_refusals.py starts it)."""
    data = _of_kind("ConfigMap")["llmp-config"]["data"]
    assert data.get("DJANGO_BEHIND_TLS_PROXY") == "1"
    assert data.get("FORWARDED_ALLOW_IPS", "").strip() == "", data.get("FORWARDED_ALLOW_IPS")
    api = _pods()["api"]["spec"]["containers"][0]
    assert {"configMapRef": {"name": "llmp-config"}} in api["envFrom"]


def _api_commands() -> dict[str, str]:
    """The api's command in each deploy form, as one string (a shell script's text, a command list joined)."""
    dockerfile = _dockerfile().replace("\\\n", " ")
    cmd = json.loads(next(ln for ln in dockerfile.splitlines() if ln.startswith("CMD "))[4:])
    unit = (DEPLOY / "systemd" / "llmp-api.service").read_text()
    return {
        "Procfile": next(ln for ln in (DEPLOY / "Procfile").read_text().splitlines() if ln.startswith("api:")),
        "llmp-api.service": next(ln for ln in unit.splitlines() if ln.startswith("ExecStart=")),
        "Dockerfile": " ".join(cmd),
        "compose.yaml": " ".join(yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["api"]["command"]),
        "k8s/api.yaml": " ".join(_pods()["api"]["spec"]["containers"][0]["command"]),
    }


#: how each form hands uvicorn the variable (its own expansion syntax, empty when unset)
_TRUSTED_FROM_THE_SETTING = {
    "Procfile": '--forwarded-allow-ips="${FORWARDED_ALLOW_IPS:-}"',
    "llmp-api.service": "--forwarded-allow-ips=${FORWARDED_ALLOW_IPS}",
    "Dockerfile": '--forwarded-allow-ips="$FORWARDED_ALLOW_IPS"',
    "compose.yaml": '--forwarded-allow-ips="$$FORWARDED_ALLOW_IPS"',
    "k8s/api.yaml": "--forwarded-allow-ips=$(FORWARDED_ALLOW_IPS)",
}


@pytest.mark.parametrize("form", sorted(_TRUSTED_FROM_THE_SETTING))
def test_every_api_command_trusts_exactly_forwarded_allow_ips(form):
    """uvicorn without ``--forwarded-allow-ips`` believes ``X-Forwarded-For`` from 127.0.0.1 when
    ``FORWARDED_ALLOW_IPS`` is unset: each deploy form passes the variable (empty: no one), as ``manage.py serve``
    passes the setting, so what ``config/startup_checks.py`` judges is what uvicorn trusts
    (test_deploy_api_live.py starts each one)."""
    command = _api_commands()[form]
    assert "uvicorn config.asgi:application" in command, command
    assert command.count("--forwarded-allow-ips") == 1 and "proxy-headers" not in command, command
    assert _TRUSTED_FROM_THE_SETTING[form] in command, command


# ------------------------------------------------------------------------------------------------ item 6
def test_k8s_every_pod_runs_locked_down():
    for name, pod in _pods().items():
        spec = pod["spec"]
        pod_sc = spec.get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") is True and pod_sc.get("runAsUser", 0) != 0, name
        assert pod_sc.get("runAsGroup", 0) != 0, name
        assert spec.get("automountServiceAccountToken") is False, name  # no process talks to the Kubernetes API
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c.get("securityContext", {})
            seccomp = sc.get("seccompProfile") or pod_sc.get("seccompProfile")
            assert seccomp == {"type": "RuntimeDefault"}, (name, c["name"])
            assert sc.get("allowPrivilegeEscalation") is False, (name, c["name"])
            assert sc.get("readOnlyRootFilesystem") is True, (name, c["name"])
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], (name, c["name"])
            assert not sc.get("capabilities", {}).get("add"), (name, c["name"])
            assert not sc.get("privileged"), (name, c["name"])


def test_k8s_writable_paths_are_mounted_in_every_pod():
    """With a read-only root filesystem, what the processes write must be a mounted volume: ``/tmp``, ``var/``
    (``LLMP_VAR_DIR``: settings make its ``static/`` at start; beat's schedule) and the user's home (caches of
    transformers and torch); the GPU engine's ``/dev/shm`` stays."""
    var_dir, home = _image_var_dir(), _image_home()
    for name, pod in _pods().items():
        spec = pod["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            writable = [m["mountPath"] for m in c.get("volumeMounts", [])
                        if not m.get("readOnly") and "emptyDir" in volumes[m["name"]]]
            for path in ("/tmp", var_dir, home):
                assert any(_under(path, w) for w in writable), (name, path, writable)
            argv = c.get("command", []) + c.get("args", [])
            if "--schedule" in argv:
                assert any(_under(argv[argv.index("--schedule") + 1], w) for w in writable), name
    gpu = _pods()["engine-gpu"]["spec"]
    assert any(m["mountPath"] == "/dev/shm" for m in gpu["containers"][0]["volumeMounts"])


def _selects(policy: dict, labels: dict) -> bool:
    sel = policy["spec"]["podSelector"]
    return set(sel.get("matchLabels", {}).items()) <= set(labels.items()) and not sel.get("matchExpressions")


def _policies_for(labels: dict) -> list[dict]:
    return [p for p in _of_kind("NetworkPolicy").values() if _selects(p, labels)]


def _public(block: dict) -> bool:
    """Whether an ``ipBlock`` peer admits some public (internet) address."""
    net = ipaddress.ip_network(block["cidr"])
    if any(net.subnet_of(p) for p in INTERNAL_NETS if p.version == net.version):
        return False
    return True


def _egress_reaches_internet(policies: list[dict]) -> list[dict]:
    return [rule for p in policies for rule in p["spec"].get("egress", [])
            if not rule.get("to") or any("ipBlock" in peer and _public(peer["ipBlock"]) for peer in rule["to"])]


def test_k8s_network_policies_deny_by_default():
    policies = _of_kind("NetworkPolicy")
    assert policies, "no NetworkPolicy"
    for name, pod in _pods().items():
        mine = _policies_for(pod["metadata"]["labels"])
        kinds = {t for p in mine for t in p["spec"].get("policyTypes", [])}
        assert {"Ingress", "Egress"} <= kinds, (name, [p["metadata"]["name"] for p in mine])


def test_k8s_only_the_image_worker_reaches_the_internet():
    """The ``mm`` worker fetches image URLs: it alone may reach public addresses, and never the cluster's private
    ones, loopback or link-local (169.254.169.254, the cloud metadata service). Every other pod reaches DNS, Redis
    and PostgreSQL (their ports on the private network) and the deployment's own pods."""
    for name, pod in _pods().items():
        mine = _policies_for(pod["metadata"]["labels"])
        internet = _egress_reaches_internet(mine)
        if name != "worker-mm":
            assert not internet, (name, internet)
            for p in mine:
                for rule in p["spec"].get("egress", []):
                    for peer in rule["to"]:
                        if "ipBlock" in peer:  # private addresses: only Redis's and PostgreSQL's ports
                            ports = {pt["port"] for pt in rule.get("ports", [])}
                            assert ports and ports <= {6379, 5432}, (name, rule)
                        elif "namespaceSelector" in peer:  # another namespace: only the cluster DNS
                            assert {pt["port"] for pt in rule.get("ports", [])} == {53}, (name, rule)
            continue
        assert internet, "worker-mm cannot fetch image URLs"
        for rule in internet:
            for peer in rule["to"]:
                block = peer["ipBlock"]
                net = ipaddress.ip_network(block["cidr"])
                excepted = [ipaddress.ip_network(e) for e in block.get("except", [])]
                for internal in INTERNAL_NETS:
                    if internal.version == net.version and internal.overlaps(net):
                        assert any(internal.subnet_of(e) for e in excepted), (block, internal)
    # both address families: an IPv6 image host is as reachable as an IPv4 one
    cidrs = {ipaddress.ip_network(peer["ipBlock"]["cidr"]).version
             for rule in _egress_reaches_internet(_policies_for(_pods()["worker-mm"]["metadata"]["labels"]))
             for peer in rule["to"]}
    assert cidrs == {4, 6}


def test_k8s_only_the_api_accepts_connections_from_outside_the_namespace():
    api_port = {p["name"]: p["containerPort"] for p in _pods()["api"]["spec"]["containers"][0]["ports"]}
    for name, pod in _pods().items():
        for p in _policies_for(pod["metadata"]["labels"]):
            for rule in p["spec"].get("ingress", []):
                peers = rule.get("from")
                assert peers, (name, "ingress from anywhere", rule)
                foreign = [peer for peer in peers if "namespaceSelector" in peer or "ipBlock" in peer]
                if foreign:
                    assert name == "api", (name, rule)
                    assert rule.get("ports") and {pt["port"] for pt in rule["ports"]} <= set(api_port) | set(
                        api_port.values()), rule


def test_k8s_kustomize_renders_the_policies():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    kinds = {d["kind"] for d in rendered}
    assert "NetworkPolicy" in kinds
    assert all(d["metadata"].get("namespace") == "llmp" for d in rendered if d["kind"] != "Namespace")


# ------------------------------------------------------------------------------------------------ item 4
HARDENING = {
    "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
    "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes", "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes", "RestrictSUIDSGID": "yes", "LockPersonality": "yes",
    "RestrictRealtime": "yes", "CapabilityBoundingSet": "", "UMask": "0077",
}


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_unit_runs_unprivileged_and_sandboxed(unit):
    service = _unit(unit)["Service"]
    user, group = service.get("User", ""), service.get("Group", "")
    assert user and user not in ("root", "0") and group and group not in ("root", "0"), unit.name
    assert service.get("DynamicUser", "no") == "no"  # one stable user owns var/ across restarts and units
    for key, want in HARDENING.items():
        assert service.get(key) == want, (unit.name, key, service.get(key))


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_unit_can_write_what_it_writes(unit):
    """``ProtectSystem=strict`` leaves only the unit's state (and runtime/cache) directories writable: ``var/``
    (``LLMP_VAR_DIR``) must be one of them, beat's schedule too, and the user's home (``~/.cache``)."""
    service = _unit(unit)["Service"]
    writable = [f"/var/lib/{d}" for d in service.get("StateDirectory", "").split()]
    writable += service.get("ReadWritePaths", "").split()
    assert writable, unit.name
    env = dict(v.split("=", 1) for v in _unit_values(unit, "Environment"))
    assert any(_under(env.get("LLMP_VAR_DIR", ""), w) for w in writable), (unit.name, env)
    assert service.get("StateDirectoryMode") == "0700"
    argv = shlex.split(service["ExecStart"])
    if "--schedule" in argv:
        assert any(_under(argv[argv.index("--schedule") + 1], w) for w in writable), unit.name
    sysusers = _sysusers()
    assert sysusers["user"] == service["User"] and any(_under(sysusers["home"], w) for w in writable)


def _sysusers() -> dict:
    """The ``u`` line of ``deploy/systemd/llmp.sysusers``: user name and home."""
    path = DEPLOY / "systemd" / "llmp.sysusers"
    for line in path.read_text().splitlines():
        if line.startswith("u "):
            fields = shlex.split(line)
            return {"user": fields[1], "home": fields[4], "shell": fields[5] if len(fields) > 5 else ""}
    raise AssertionError("no user in llmp.sysusers")


def test_systemd_user_is_a_system_user_without_a_login(tmp_path):
    tool = shutil.which("systemd-sysusers")
    if tool is None:
        pytest.skip("systemd-sysusers is not installed")
    (tmp_path / "etc").mkdir()
    out = subprocess.run([tool, "--root", str(tmp_path), str(DEPLOY / "systemd" / "llmp.sysusers")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    entry = next(ln.split(":") for ln in (tmp_path / "etc" / "passwd").read_text().splitlines()
                 if ln.startswith(_sysusers()["user"] + ":"))
    assert 0 < int(entry[2]) < 1000 and entry[5] == _sysusers()["home"] and entry[6].endswith("nologin"), entry


def _systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    return tool


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_security_exposure(unit):
    """systemd's own score of the sandbox (``systemd-analyze security``): the root units scored 9.6 "UNSAFE"; each
    is now at most 4.9 ("OK")."""
    out = subprocess.run([_systemd_analyze(), "security", "--offline=yes", "--no-pager", str(unit)],
                         capture_output=True, text=True, timeout=120)
    level = re.search(r"Overall exposure level for \S+: ([\d.]+)", out.stdout)
    assert level, out.stdout[-2000:] + out.stderr[-2000:]
    assert float(level.group(1)) <= 4.9, (unit.name, level.group(1))


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_unit_parses(unit):
    """``systemd-analyze verify``: no unknown or malformed setting (it also reports the interpreter missing here,
    /opt/llmp/.venv, which is expected on a machine the platform is not installed on)."""
    out = subprocess.run([_systemd_analyze(), "verify", str(unit)], capture_output=True, text=True, timeout=120)
    expected = ("is not executable", "Failed to prepare", "Unit configuration has fatal error")
    other = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip() and not any(e in ln for e in expected)]
    assert not other, other
