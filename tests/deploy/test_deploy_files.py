"""The deployment files under ``deploy/`` (issue 18) are well formed and run real commands with real settings.

* ``deploy/compose.yaml``: ``docker compose config -q`` (or ``docker-compose``) accepts it with
  ``deploy/compose.env.example`` and refuses it without the secrets; skipped only where neither is installed.
* ``deploy/k8s/``: every manifest parses (``yaml.safe_load_all``) with the fields its kind needs; selectors match
  their pod labels, Services and HorizontalPodAutoscalers name what exists, ConfigMap/Secret/PVC references resolve,
  the GPU engine requests ``nvidia.com/gpu``, and the queue-depth HPA reads the metric ``/metrics`` exports.
* Every environment variable the files set is one the settings readers read (``platform/config/settings.py``,
  ``inference/shared/config.py``), or one their own command expands.
* Every command is one the code accepts: ``python -m inference.engine`` arguments parse with its own parser,
  uvicorn's with uvicorn's, Celery queues are the routed ones, and ``manage.py serve --no-engine`` (the README's
  render-only frontend) exists.
"""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from inference.shared.config import InferenceSettings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose.yaml"
COMPOSE_ENV = DEPLOY / "compose.env.example"
APP_IMAGES = {"llmp", "llmp-cuda"}
QUEUES = {"render", "usage", "mm"}
SETTING_READERS = {"_env_first", "_env_bool", "_env_list", "_env_json_object", "get"}


# ------------------------------------------------------------------------------------------------ helpers
def settings_names() -> set[str]:
    """Environment variable names read by the two settings readers (string arguments of their reader calls and
    dj-database-url's ``env=``; ``InferenceSettings``' fields upper-cased)."""
    names = {name.upper() for name in InferenceSettings.__dataclass_fields__}
    tree = ast.parse((REPO / "platform" / "config" / "settings.py").read_text())
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        fname = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if fname in SETTING_READERS:
            names |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                      and re.fullmatch(r"[A-Z][A-Z0-9_]+", a.value)}
        names |= {kw.value.value for kw in node.keywords
                  if kw.arg == "env" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str)}
    return names


def k8s_docs() -> list[tuple[str, dict]]:
    """``(file name, document)`` of every manifest: kustomization.yaml's resources and monitoring/'s files."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = [K8S / name for name in kustomization["resources"]] + sorted((K8S / "monitoring").glob("*.yaml"))
    docs = []
    for path in files:
        if path.name == "prometheus-adapter-values.yaml":  # Helm values, not a manifest
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def by_kind(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for _f, doc in k8s_docs() if doc["kind"] == kind}


def pod_specs() -> dict[str, dict]:
    """Pod specs of the Deployments and Jobs, by name."""
    return {name: doc["spec"]["template"]["spec"] for kind in ("Deployment", "Job") for name, doc in by_kind(kind).items()}


def check_command(argv: list[str]) -> None:
    """Fail unless ``argv`` (``$(VAR)``, ``$VAR`` and ``${...}`` already replaced) is a command the project runs
    and its arguments parse."""
    if argv[:3] == ["python", "-m", "inference.engine"]:
        from inference.engine.__main__ import parse_args

        try:
            parse_args(argv[3:])
        except SystemExit as exc:
            pytest.fail(f"inference.engine refuses {argv[3:]}: exit {exc.code}")
    elif argv[:3] == ["python", "-m", "uvicorn"]:
        from uvicorn.main import main

        params = main.make_context("uvicorn", argv[3:]).params
        assert params["app"] == "config.asgi:application" and params["app_dir"] == "platform", argv
        assert "application = " in (REPO / "platform" / "config" / "asgi.py").read_text()
    elif argv[0] == "celery":
        assert argv[1:5] == ["-A", "config", "--workdir", "platform"], argv
        assert (REPO / "platform" / "config" / "celery.py").is_file()
        assert argv[5] in ("worker", "beat"), argv
        if argv[5] == "worker":
            queues = set(argv[argv.index("-Q") + 1].split(","))
            assert queues and queues <= QUEUES, argv
    elif argv[:2] == ["python", "manage.py"]:
        from django.core.management import get_commands

        assert argv[2] in get_commands(), argv
    else:
        pytest.fail(f"unknown command {argv}")


def _expand(argv: list[str], values: dict[str, str]) -> list[str]:
    """``$(VAR)``, ``$$VAR``, ``$VAR``, ``${VAR...}`` and systemd's ``%i`` replaced by ``values`` (else the
    ``${VAR:-default}``'s default, else ``x``)."""
    def sub(word: str) -> str:
        word = re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), "x"), word)
        word = re.sub(r"\$\{(\w+)(?::-([^}]*))?[^}]*\}", lambda m: values.get(m.group(1), m.group(2) or "x"), word)
        word = re.sub(r"\$\$?(\w+)", lambda m: values.get(m.group(1), "x"), word)
        return word.replace("%i", "x")
    return [sub(w) for w in argv]


def container_argv(container: dict) -> list[str]:
    """A container's full command; ``sh -c 'exec ...'`` unwrapped."""
    argv = list(container.get("command", [])) + list(container.get("args", []))
    if argv[:2] == ["sh", "-c"]:
        argv = shlex.split(argv[2])
        argv = argv[1:] if argv[0] == "exec" else argv
    return argv


def expanded_vars(argv: list[str]) -> set[str]:
    """Names the command itself expands (``$(VAR)``, ``$VAR``, ``$$VAR``)."""
    return {m.group(1) for w in argv for m in re.finditer(r"\$\(?\$?\{?(\w+)", w)}


# ------------------------------------------------------------------------------------------------ compose
def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, timeout=60).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def _compose(*args: str, env_file: Path) -> subprocess.CompletedProcess:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    return subprocess.run([*cli, "--env-file", str(env_file), "-f", str(COMPOSE), *args], capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/local/bin:/usr/bin:/bin"}, cwd=REPO)


def test_compose_config_validates():
    out = _compose("config", "-q", env_file=COMPOSE_ENV)
    assert out.returncode == 0, out.stderr


def test_compose_refuses_missing_secrets(tmp_path):
    empty = tmp_path / "empty.env"
    empty.write_text("")
    out = _compose("config", "-q", env_file=empty)
    assert out.returncode != 0 and "REDIS_PASSWORD" in out.stderr, out.stderr


def _compose_services() -> dict[str, dict]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_compose_has_every_process_type():
    services = _compose_services()
    assert {"redis", "postgres", "migrate", "api", "worker-render", "worker-usage", "worker-mm", "beat", "engine",
            "engine-gpu"} <= set(services)
    gpu = services["engine-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    queues = set()
    for svc in services.values():
        if "build" not in svc:
            continue
        argv = _expand(container_argv(svc), {"MODEL": "m"})
        check_command(argv)
        if argv[0] == "celery" and argv[5] == "worker":
            queues |= set(argv[argv.index("-Q") + 1].split(","))
    assert queues == QUEUES
    assert services["worker-render"]["environment"]["CELERY_REDELIVER_AFTER_S"] == "6"


def test_compose_env_names_are_settings():
    known = settings_names()
    for name, svc in _compose_services().items():
        if "build" not in svc:  # Redis and PostgreSQL images read their own variables
            continue
        extra = set(svc["environment"]) - known - expanded_vars(container_argv(svc))
        assert not extra, (name, extra)


# ------------------------------------------------------------------------------------------------ kubernetes
REQUIRED_SPEC = {"Deployment": ("selector", "template"), "Service": ("selector", "ports"), "Job": ("template",),
                 "HorizontalPodAutoscaler": ("scaleTargetRef", "minReplicas", "maxReplicas", "metrics"),
                 "PersistentVolumeClaim": ("accessModes", "resources"), "ServiceMonitor": ("selector", "endpoints")}


def test_k8s_manifests_parse_with_required_fields():
    docs = k8s_docs()
    kinds = {doc["kind"] for _f, doc in docs}
    assert {"Namespace", "ConfigMap", "Secret", "PersistentVolumeClaim", "Job", "Deployment", "Service",
            "HorizontalPodAutoscaler", "ServiceMonitor"} <= kinds
    for fname, doc in docs:
        assert doc.get("apiVersion") and doc.get("kind") and doc.get("metadata", {}).get("name"), (fname, doc)
        for field in REQUIRED_SPEC.get(doc["kind"], ()):
            assert field in doc["spec"], (fname, doc["metadata"]["name"], field)
    assert {"api", "worker-render", "worker-usage", "worker-mm", "beat", "engine", "engine-gpu"} <= set(
        by_kind("Deployment"))
    assert by_kind("Deployment")["beat"]["spec"]["replicas"] == 1


def test_k8s_selectors_and_references_resolve():
    deployments = by_kind("Deployment")
    for name, dep in deployments.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
    configmaps, secrets, pvcs = by_kind("ConfigMap"), by_kind("Secret"), by_kind("PersistentVolumeClaim")
    for name, spec in pod_specs().items():
        for c in spec["containers"]:
            assert c["image"] in APP_IMAGES, (name, c["image"])
            for ref in c.get("envFrom", []):
                if "configMapRef" in ref:
                    assert ref["configMapRef"]["name"] in configmaps, name
                if "secretRef" in ref:
                    assert ref["secretRef"]["name"] in secrets, name
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec.get("volumes", [])}, name
        for vol in spec.get("volumes", []):
            if "persistentVolumeClaim" in vol:
                assert vol["persistentVolumeClaim"]["claimName"] in pvcs, name
    for name, svc in by_kind("Service").items():
        targets = [d for d in deployments.values()
                   if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert targets, name
        ports = {p["name"] for d in targets for c in d["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, name
    for name, hpa in by_kind("HorizontalPodAutoscaler").items():
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["name"] in deployments, name
    monitor = by_kind("ServiceMonitor")["llmp-api"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["spec"]["endpoints"][0]["bearerTokenSecret"]["name"] in secrets


def test_k8s_gpu_engine_requests_a_gpu_and_scales_on_the_admission_queue():
    gpu = pod_specs()["engine-gpu"]["containers"][0]
    assert gpu["resources"]["requests"]["nvidia.com/gpu"] == gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "cuda" in _expand(container_argv(gpu), {})
    hpa = by_kind("HorizontalPodAutoscaler")["engine-gpu"]
    metric = hpa["spec"]["metrics"][0]
    assert metric["type"] == "External"
    # the adapter publishes /metrics' admission_queued_requests under this name (monitoring/)
    adapter = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    rule = adapter["rules"]["external"][0]
    assert metric["external"]["metric"]["name"] == rule["name"]["as"]
    assert rule["seriesQuery"].startswith("admission_queued_requests{")
    assert '"admission_queued_requests"' in (REPO / "platform" / "gateway" / "endpoints" / "metrics.py").read_text()


def test_k8s_commands_run_real_entry_points():
    queues = set()
    for spec in pod_specs().values():
        for c in spec["containers"]:
            env = {e["name"]: e.get("value", "x") for e in c.get("env", [])}
            argv = _expand(container_argv(c), env)
            check_command(argv)
            if argv[0] == "celery" and argv[5] == "worker":
                queues |= set(argv[argv.index("-Q") + 1].split(","))
    assert queues == QUEUES


def test_k8s_env_names_are_settings():
    known = settings_names()
    for name, cm in by_kind("ConfigMap").items():
        assert not set(cm["data"]) - known, (name, set(cm["data"]) - known)
    for name, secret in by_kind("Secret").items():
        if name == "llmp-metrics-token":  # Prometheus's bearer token, not the platform's
            continue
        assert not set(secret["stringData"]) - known, (name, set(secret["stringData"]) - known)
    for name, spec in pod_specs().items():
        for c in spec["containers"]:
            extra = {e["name"] for e in c.get("env", [])} - known - expanded_vars(container_argv(c))
            assert not extra, (name, extra)


# ------------------------------------------------------------------------------------------------ Procfile, systemd
def test_procfile_and_systemd_units_run_real_commands():
    lines = [ln.split(":", 1)[1] for ln in (DEPLOY / "Procfile").read_text().splitlines()
             if ln and not ln.startswith("#")]
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        lines += [ln.split("=", 1)[1] for ln in unit.read_text().splitlines() if ln.startswith("ExecStart=")]
    assert len(lines) >= 7
    known = settings_names()
    for line in lines:
        argv = shlex.split(line)
        while "=" in argv[0]:  # VAR=value before the command
            assert argv.pop(0).split("=")[0] in known, line
        argv[0] = Path(argv[0]).name  # /opt/llmp/.venv/bin/python → python
        check_command(_expand(argv, {}))


def test_render_only_frontend_command_exists():
    """deploy/README.md's render-only frontend machine runs ``manage.py serve --no-engine``."""
    from ops.management.commands.serve import Command

    opts = Command().create_parser("manage.py", "serve").parse_args(["--no-engine", "--host", "0.0.0.0"])
    assert opts.no_engine
    assert "serve --no-engine" in (DEPLOY / "README.md").read_text()


def test_env_files_and_units_set_only_settings():
    known = settings_names()
    names = {ln.split("=", 1)[0] for ln in (DEPLOY / "env.example").read_text().splitlines()
             if ln and not ln.startswith("#")}
    assert {"REDIS_URL", "DATABASE_URL", "DJANGO_SECRET_KEY", "API_KEY_PEPPER"} <= names
    assert not names - known, names - known
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        for ln in unit.read_text().splitlines():
            if ln.startswith("Environment="):
                name = ln.split("=", 2)[1]
                assert name in known, (unit.name, name)
