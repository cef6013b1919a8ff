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
PACKAGES = ("gateway", "inference", "tenancy", "usage", "registry", "admission", "config", "ops")


def test_import_linter_contracts_hold():
    """``lint-imports`` (pyproject.toml ``[tool.importlinter]``) exits 0: the gateway's layers, a Django-free
    ``inference``, torch/transformers only where they belong."""
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
