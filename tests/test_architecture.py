"""Architecture checks: the import-linter contracts of pyproject.toml hold, and no import cycle exists among the
project's modules (module-level and function-level imports alike)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "inference", "tenancy", "usage", "registry", "admission", "config", "ops", "audit")


def test_import_linter_contracts_hold():
    """``lint-imports`` (pyproject.toml ``[tool.importlinter]``) exits 0: the gateway's layers, a Django-free
    ``inference``, torch/transformers only where they belong, ``bench`` and ``tests`` sharing only ``harness``."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "import-linter is not installed (pip install -e '.[test]')"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)])}
    proc = subprocess.run([exe, "--no-cache"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in graph.modules:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles():
    """No two project modules import each other, directly or through others (a package's ``__init__`` that
    re-exports its own submodules aside)."""
    sys.path[:0] = [str(REPO / "platform"), str(REPO)]
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    for pkg in graph.modules:  # a package importing its own children is not a cycle
        for child in graph.find_children(pkg):
            if graph.direct_import_exists(importer=pkg, imported=child):
                graph.remove_import(importer=pkg, imported=child)
    assert _cycles(graph) == []


def test_limit_codes_are_public_error_codes():
    """Every 429 code the key limits raise is one of the public ``ErrorCode`` s; concurrency has its own."""
    from inference.protocol.errors import ErrorCode
    from tenancy.limits import LIMIT_CODES

    assert set(LIMIT_CODES.values()) <= {c.value for c in ErrorCode}
    assert LIMIT_CODES["concurrency"] != LIMIT_CODES["rpm"]


# ----------------------------------------------------------------------------------- one settings reader
# The environment is read by ``platform/config/settings.py`` (Django side) and ``inference/shared/config.py`` (the
# Django-free side) only. Besides them, only these uses of ``os.environ`` are allowed: setting Django's settings
# module before Django starts, and copying the environment for child processes (not reading a setting).
SETTINGS_READERS = {"platform/config/settings.py", "inference/shared/config.py"}
ENVIRON_ALLOWED = {
    ("manage.py", 'os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")'),
    ("platform/config/asgi.py", 'os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")'),
    ("platform/config/celery.py", 'os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")'),
    ("platform/ops/mm_api.py", 'os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")'),
    ("platform/ops/management/commands/serve.py", "dict(os.environ)"),  # the children's environment
}


def _source_files() -> list[Path]:
    """The project's own Python files: ``platform/`` (migrations aside), ``inference/`` and ``manage.py``."""
    files = [REPO / "manage.py", *sorted((REPO / "inference").rglob("*.py")), *sorted((REPO / "platform").rglob("*.py"))]
    return [p for p in files if "migrations" not in p.parts]


def _environ_uses(path: Path) -> list[tuple[int, str]]:
    """``(line, source of the enclosing expression)`` of every ``os.environ``/``os.getenv``/``os.putenv`` use and
    every ``from os import environ/getenv`` in ``path``."""
    import ast

    text = path.read_text()
    tree = ast.parse(text)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os" and \
                {a.name for a in node.names} & {"environ", "getenv", "environb", "getenvb"}:
            out.append((node.lineno, ast.get_source_segment(text, node) or ""))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" and \
                node.attr in {"environ", "getenv", "environb", "getenvb", "putenv"}:
            outer = node
            while isinstance(parents.get(outer), (ast.Attribute, ast.Call, ast.Subscript)):
                outer = parents[outer]
            out.append((node.lineno, ast.get_source_segment(text, outer) or ""))
    return out


def test_only_the_settings_modules_read_the_environment():
    """No module but ``config/settings.py`` and ``inference/shared/config.py`` reads ``os.environ`` / ``os.getenv``."""
    found = []
    for path in _source_files():
        rel = path.relative_to(REPO).as_posix()
        if rel in SETTINGS_READERS:
            continue
        for line, source in _environ_uses(path):
            if (rel, source) not in ENVIRON_ALLOWED:
                found.append(f"{rel}:{line}: {source}")
    assert found == []


def test_the_inference_reader_keeps_names_and_defaults():
    """``inference/shared/config.py`` reads each variable under its documented name; unset or empty means the default."""
    from inference.shared.config import InferenceSettings

    assert InferenceSettings.from_env({}) == InferenceSettings()
    read = InferenceSettings.from_env({"RENDER_TIME_LIMIT_S": "1.5", "MM_BLOB_TTL_S": "7", "REDIS_URL": "redis://x",
                                       "MM_FETCH_ALLOW_NETS": "", "ENGINE_LOG_LEVEL": "DEBUG"})
    assert (read.render_time_limit_s, read.mm_blob_ttl_s, read.redis_url) == (1.5, 7, "redis://x")
    assert (read.mm_fetch_allow_nets, read.engine_log_level) == (None, "DEBUG")
    assert type(read.mm_blob_ttl_s) is int and type(read.render_time_limit_s) is float
    doc = (REPO / "inference" / "shared" / "config.py").read_text()
    for name in InferenceSettings.__dataclass_fields__:
        assert f"``{name.upper()}``" in doc, f"{name.upper()} is not documented in inference/shared/config.py"


# ---------------------------------------------------------------------- no project imports inside functions
PROJECT_PACKAGES = set(PACKAGES)
# (file, function, imported module): the documented exceptions, each with a comment at the import saying why.
FUNCTION_IMPORTS_ALLOWED = {
    # torch and the model code load after the engine's arguments parse
    ("inference/engine/__main__.py", "_scheduler", ".runner"),
    ("inference/engine/__main__.py", "_scheduler", ".pooling"),
    ("inference/engine/__main__.py", "_scheduler", ".scheduler"),
    ("inference/engine/__main__.py", "_scheduler", ".vl_runner"),
    # vLLM reads its environment (VLLM_CPU_KVCACHE_SPACE, ...) when imported: loaded after main() sets it
    ("inference/engine/vllm_backend/__main__.py", "main", ".runner"),
    ("inference/engine/vllm_backend/__main__.py", "main", ".scheduler"),
    # models cannot be imported before the app registry is ready; Celery is optional for management commands
    ("platform/admission/apps.py", "ready", ".models"),
    ("platform/admission/apps.py", "ready", ".services"),
    ("platform/admission/apps.py", "ready", "config.celery"),
    ("platform/audit/apps.py", "ready", ".context"),
    ("platform/tenancy/apps.py", "ready", ".invalidation"),
    ("platform/tenancy/apps.py", "ready", ".models"),
    # config.celery is imported with the settings, before the apps are ready; only render workers load the renderer
    ("platform/config/celery.py", "_warm_renderer", "inference.renderer.chat_template"),
    ("platform/config/celery.py", "_warm_renderer", "registry.selectors"),
}


def _function_level_project_imports(path: Path) -> list[tuple[str, str, int]]:
    """``(function, module, line)`` of each import of a project module (or a relative one) inside a function."""
    import ast

    out = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["." * node.level + (node.module or "")]
            else:
                continue
            out += [(fn.name, n, node.lineno) for n in names
                    if n.startswith(".") or n.split(".")[0] in PROJECT_PACKAGES]
    return out


def test_no_project_imports_inside_functions():
    """Project modules are imported at module level, except the listed, commented lazy loads."""
    found = []
    for path in _source_files():
        rel = path.relative_to(REPO).as_posix()
        for fn, module, line in _function_level_project_imports(path):
            if (rel, fn, module) not in FUNCTION_IMPORTS_ALLOWED:
                found.append(f"{rel}:{line}: {module} inside {fn}()")
    assert sorted(set(found)) == []
