"""The linters run with the tests: ``ruff check .`` over the whole tree and ``mypy`` (strict on ``inference`` and
the gateway), both configured in ``pyproject.toml``. A failure shows the tool's own report."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(tool: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    exe = BIN / tool
    if not exe.exists():
        pytest.fail(f"{tool} is not installed next to {sys.executable}: pip install -e '.[test]'")
    return subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_ruff_is_clean() -> None:
    result = _run("ruff", "check", ".", "--output-format", "concise", "--no-cache", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# mypy's cache is kept for the machine, beside vLLM's environment (scripts/setup.sh), not in the checkout: a first run
# reads torch's and transformers' annotations (~85 s on 2 cores), which a fresh clone would otherwise do again. mypy
# keys its cache on module names and content hashes, so checkouts at other paths and commits share it soundly.
MYPY_CACHE = Path(os.environ.get("LLMP_MYPY_CACHE") or Path.home() / ".cache" / "llm-serving-platform" / "mypy")


@pytest.mark.timeout(600)
def test_mypy_is_clean() -> None:
    result = _run("mypy", "--cache-dir", str(MYPY_CACHE), timeout=590)
    assert result.returncode == 0, result.stdout + result.stderr


# -- sizes ------------------------------------------------------------------------------------------------------------
# Issue 40: a reader takes in a function or a class whole. Lines are counted from the `def`/`class` line to the last
# line of the body, docstring included, decorators not; Django's generated migrations are left out.
SIZE_ROOTS = ("inference", "platform")
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 400


def _python_files(*roots: str) -> list[Path]:
    """The ``.py`` files under ``roots`` (paths relative to the repository), migrations left out, sorted."""
    return sorted(p for root in roots for p in (ROOT / root).rglob("*.py") if "migrations" not in p.parts)


def _oversized_definitions(path: Path) -> list[str]:
    """``path:line Qualified.name: N lines (limit L)`` for each function over ``MAX_FUNCTION_LINES`` and each class
    over ``MAX_CLASS_LINES`` in ``path`` (nested definitions included, named through their parents)."""
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                limit = MAX_CLASS_LINES if isinstance(child, ast.ClassDef) else MAX_FUNCTION_LINES
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(ROOT)}:{child.lineno} {name}: {lines} lines (limit {limit})")
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), "")
    return found


def test_no_function_or_class_is_oversized() -> None:
    """No function over 80 lines and no class over 400 in ``inference/`` and ``platform/`` (migrations excluded)."""
    oversized = [line for path in _python_files(*SIZE_ROOTS) for line in _oversized_definitions(path)]
    assert not oversized, "split these by job:\n" + "\n".join(oversized)


# -- dead code --------------------------------------------------------------------------------------------------------
# vulture (pyproject.toml's test extra) reads the product code, the benches, their shared harness and scripts, and also
# tests/ and manage.py, whose uses count: a definition only the tests use is a test hook, not dead. Findings are checked
# in DEAD_CODE_ROOTS only. 60 is vulture's confidence for an unreferenced function, class, method, attribute or variable (100: unused
# arguments, unreachable code), so everything it can tell is checked.
DEAD_CODE_ROOTS = ("inference", "platform", "bench", "harness", "scripts")
DEAD_CODE_MIN_CONFIDENCE = 60

# Decorators whose functions and classes a framework calls or reads by name (vulture's --ignore-decorators).
DEAD_CODE_DECORATORS = {
    "@admin.register": "Django admin classes: registered with the admin site",
    "@admin.display": "admin columns: named in list_display strings",
    "@admin.action": "admin actions: named in actions strings",
    "@shared_task": "Celery tasks: called by name through the broker",
    "@*.connect": "Celery and Django signal receivers",
    "@register": "Django system checks",
    "@model_validator": "pydantic validators: run by their model",
    "@field_validator": "pydantic validators: run by their model",
    "@extend_schema_field": "drf-spectacular schema hints on serializer fields",
    "@atexit.register": "run when the interpreter exits",
}

# Names a framework calls or reads wherever they are defined (vulture's --ignore-names; globs), by reason.
DEAD_CODE_FRAMEWORK_NAMES = {
    "Django models' Meta and app configs": (
        "Meta", "abstract", "constraints", "indexes", "ordering", "verbose_name", "verbose_name_plural",
        "default_auto_field", "*Config", "default_site"),
    "Django admin and form options and hooks": (
        "list_display", "search_fields", "fieldsets", "raw_id_fields", "inlines", "list_select_related", "actions",
        "date_hierarchy", "show_full_result_count", "can_delete", "show_change_link", "parameter_name", "lookups",
        "has_*_permission", "get_fields", "prepare_value", "clean_*"),
    "Django management commands": ("Command", "help", "add_arguments", "handle"),
    "Django REST framework views, serializers, permissions and pagination": (
        "read_only_fields", "http_method_names", "serializer_class", "pagination_class", "authentication_classes",
        "permission_classes", "parser_classes", "renderer_classes", "has_permission", "get_exception_handler",
        "permission_denied", "get_page_size"),
    "drf-spectacular's authentication extensions": ("target_class", "get_security_definition"),
    "Django's request.user protocol, middleware flags and error handlers": (
        "is_anonymous", "is_superuser", "sync_capable", "async_capable", "handler404", "handler500"),
    "Channels consumers: ASGI events and channel-layer message types name their handlers": (
        "channel_layer_alias", "dispatch", "http_request", "http_disconnect", "receive_json"),
    "Jinja2 sandbox, extension and node visitor hooks": (
        "tags", "intercepted_binops", "code_generator_class", "unsafe_undefined", "visit_*"),
    "torch modules: forward runs through __call__": ("forward",),
}

# Definitions used where vulture cannot see (path glob relative to the repository, names, reason). An entry that no
# longer matches a finding fails the test: remove it. "pending: AREA" marks unreferenced definitions in an area
# another change is rewriting (issue 40), to be removed there with their entries; they are not checked for staleness
# (the definition may still be used on one side of that change).
DEAD_CODE_ALLOWED: list[tuple[str, tuple[str, ...], str]] = [
    ("platform/config/settings.py", ("[A-Z]*",), "Django, Celery and app settings: read by name"),
    ("platform/*/models.py", ("ttft_sum_ms", "e2e_sum_ms", "advanced_at", "replaced_by"),
     "database columns: read and written through the ORM by name"),
    ("platform/tenancy/services.py", ("replaced_by",), "a database column (ApiKey.replaced_by), saved by name"),
    ("platform/usage/key_ranges.py", ("advanced_at",), "a database column, saved by name"),
    ("platform/registry/models.py", ("FLOAT32", "BFLOAT16", "FLOAT16", "CUDA", "EMBED"),
     "TextChoices members: the field's choices"),
    ("platform/*/api/serializers.py", ("get_operation", "get_source", "get_status"),
     "SerializerMethodField getters (get_<field>)"),
    ("platform/tenancy/api/serializers.py", ("grace_period_s",), "a request field, read from validated_data by key"),
    ("platform/tenancy/api/base.py", ("_audit_token",), "popped through self.__dict__ when the response is final"),
    ("platform/tenancy/api/base.py", ("ApiKeyAuthenticationScheme",),
     "a drf-spectacular extension: registered by subclassing"),
    ("platform/tenancy/api/base.py", ("auto_schema",), "drf-spectacular's get_security_definition signature"),
    ("platform/audit/admin.py", ("model_admin",), "Django's SimpleListFilter.lookups signature"),
    ("platform/ops/checks.py", ("app_configs",), "Django's system check signature"),
    ("platform/audit/context.py", ("AuditContextMiddleware",), "named in settings.MIDDLEWARE"),
    ("platform/config/admin_site.py", ("PlatformOTPAdminSite",), "named by OTPAdminConfig.default_site"),
    ("platform/config/errors.py", ("server_error",), "named by handler500 in config/urls.py"),
    ("platform/config/celery.py", ("requires",), "a Celery bootstep's dependencies"),
    ("inference/shared/structured_probe.py", ("special_token_ids",), "read by llguidance.TokenizerWrapper"),
    ("platform/usage/consumers.py", ("usage_updated",), "the handler of the channel layer's usage.updated messages"),
    ("inference/protocol/errors.py", ("CONCURRENCY_LIMIT_EXCEEDED",),
     "written by value by tenancy/limits.py (LIMIT_CODES; tests/test_architecture.py checks they are ErrorCodes)"),
    ("inference/protocol/openai.py", ("tool_call_id",), "a field of the tool message clients send"),
    ("inference/workers/render_limits.py", ("watchdog_pid",),
     "read by tests/renderer/test_render_limits.py in a child process's source text"),
    ("inference/renderer/sandbox.py", ("_render_body",), "called by name by GenerationTag's CallBlock"),
    ("inference/renderer/sandbox.py", ("compare_guard", "loop_guard", "concat_guard"),
     "called by the compiled templates (_GuardedCodeGenerator, _GuardInserter)"),
    ("inference/renderer/sandbox.py", ("blank", "break_long_words", "break_on_hyphens"),
     "parameters of Jinja's filters, which the prechecks take as the filters do"),
    ("inference/renderer/sandbox.py", ("__self",), "Jinja's SandboxedEnvironment.call signature"),
    ("inference/renderer/tokenizer_cache.py", ("encode_special_tokens",), "a tokenizers.Tokenizer setting, set here"),
    ("bench/*.py", ("padding_side",), "a transformers tokenizer setting, set there"),
    ("scripts/build_demo_model.py", ("generation_config",),
     "a transformers model attribute, written to generation_config.json by save_pretrained"),
    ("inference/engine/*", ("get_seq_length", "get_query_offset", "get_mask_sizes", "query_length"),
     "transformers' Cache interface, called by the model"),
    ("inference/engine/*", ("max_seq_length",), "a PoolingRecipe TypedDict key, read by subscript"),
    ("inference/engine/*", ("special_token_ids",), "read by llguidance's TokenizerWrapper"),
    ("inference/engine/*", ("tokenizer_ready", "dim"), "pending: inference/engine"),
    ("inference/protocol/engine.py", ("started_at",), "pending: inference/protocol (EngineStats, sent, never read)"),
    ("platform/gateway/*", ("as_dict", "revision", "ERROR_TABLE"), "pending: platform/gateway"),
]


def _dead_code_findings() -> list[tuple[str, str, str]]:
    """``(path relative to the repository, name, vulture's report line)`` for each definition vulture finds
    unreferenced in ``DEAD_CODE_ROOTS`` (migrations aside), with the framework rules above applied."""
    import vulture  # the test extra; imported here so that the other lint tests run without it

    names = [name for group in DEAD_CODE_FRAMEWORK_NAMES.values() for name in group]
    scanner = vulture.Vulture(ignore_names=names, ignore_decorators=list(DEAD_CODE_DECORATORS))
    scanner.scavenge([str(ROOT / p) for p in (*DEAD_CODE_ROOTS, "tests", "manage.py")], exclude=["*/migrations/*"])
    found = []
    for item in scanner.get_unused_code(min_confidence=DEAD_CODE_MIN_CONFIDENCE):
        rel = Path(item.filename).resolve().relative_to(ROOT)
        if rel.parts[0] in DEAD_CODE_ROOTS:
            found.append((rel.as_posix(), item.name, item.get_report().replace(f"{ROOT}/", "")))
    return found


def test_no_dead_code() -> None:
    """No function, class, method, attribute or variable that nothing references (vulture), except the framework
    hooks and the uses vulture cannot see that are listed above with their reasons; no stale allow-list entry."""
    import fnmatch

    findings = _dead_code_findings()
    used: set[tuple[str, str]] = set()
    dead = []
    for path, name, report in findings:
        entry = next(((glob, n) for glob, allowed, _ in DEAD_CODE_ALLOWED for n in allowed
                      if fnmatch.fnmatchcase(path, glob) and fnmatch.fnmatchcase(name, n)), None)
        if entry is None:
            dead.append(report)
        else:
            used.add(entry)
    stale = [f"{glob}: {n}" for glob, allowed, reason in DEAD_CODE_ALLOWED for n in allowed
             if (glob, n) not in used and not reason.startswith("pending:")]
    assert not dead, "unreferenced (remove it, or list it in DEAD_CODE_ALLOWED with its reason):\n" + "\n".join(dead)
    assert not stale, "DEAD_CODE_ALLOWED entries that match nothing any more (remove them):\n" + "\n".join(stale)


# ``Any`` allowed in the signatures of gateway/pipeline (module:qualname:name), each with its reason (issue 40)
PIPELINE_ANY_ALLOWED = {
    "rendering.py:<module>:_INLINE": "the render tasks' wire bodies, JSON in and out; call_inline wraps them in the "
                                     "typed request and answer (inference.protocol.render)",
}


def test_no_any_in_pipeline_signatures() -> None:
    """Strict mypy checks the request path's seams only where they are typed: no ``Any`` in the parameters and
    returns of ``platform/gateway/pipeline/*.py``'s functions and methods (nested ones too), in their classes'
    annotated fields, or in module-level type aliases and annotations, but the allow-list above."""
    import ast

    def mentions_any(node: ast.AST | None) -> bool:
        return node is not None and any(
            (isinstance(n, ast.Name) and n.id == "Any") or (isinstance(n, ast.Attribute) and n.attr == "Any")
            or (isinstance(n, ast.Constant) and isinstance(n.value, str) and "Any" in n.value)
            for n in ast.walk(node))

    found: list[str] = []

    def scan(module: str, node: ast.AST, scope: list[str], in_function: bool = False) -> None:
        for child in ast.iter_child_nodes(node):
            where = f"{module}:{'.'.join(scope) or '<module>'}"
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a, name = child.args, f"{module}:{'.'.join([*scope, child.name])}"
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, [a.vararg, a.kwarg])]:
                    if mentions_any(arg.annotation):
                        found.append(f"{name}:{arg.arg}")
                if mentions_any(child.returns):
                    found.append(f"{name}:return")
                scan(module, child, [*scope, child.name], True)  # nested functions; annotated locals are skipped
            elif isinstance(child, ast.ClassDef):
                scan(module, child, [*scope, child.name])
            elif in_function:
                continue
            elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):  # fields, module names
                if mentions_any(child.annotation):
                    found.append(f"{where}:{child.target.id}")
            elif isinstance(child, ast.Assign) and isinstance(child.value, (ast.Subscript, ast.BinOp)) and \
                    mentions_any(child.value):  # a type alias
                found.extend(f"{where}:{t.id}" for t in child.targets if isinstance(t, ast.Name))

    for path in sorted((ROOT / "platform" / "gateway" / "pipeline").glob("*.py")):
        scan(path.name, ast.parse(path.read_text(), str(path)), [])
    unexplained = sorted(set(found) - set(PIPELINE_ANY_ALLOWED))
    assert not unexplained, "Any in gateway/pipeline signatures (type them, or allow-list with a reason):\n" + \
        "\n".join(unexplained)
    stale = sorted(set(PIPELINE_ANY_ALLOWED) - set(found))
    assert not stale, f"allow-listed but gone (drop from PIPELINE_ANY_ALLOWED): {stale}"


# -- duplicate code ---------------------------------------------------------------------------------------------------
# pylint's similarity checker (Symilar, behind its duplicate-code message; pylint is in the test extra): runs of
# DUPLICATE_MIN_LINES or more lines alike between two files, comments, docstrings, imports and function signatures
# aside (pylint's --ignore-* options; the imports and signatures are blanked here with Python's ast first, as pylint
# does with astroid, which re-parses every file: 4 minutes for this tree on 2 cores against 2 s).
DUPLICATE_ROOTS = ("inference", "platform", "bench", "harness", "scripts", "tests")
DUPLICATE_MIN_LINES = 6

# Pairs of files allowed to share such runs ((sorted paths), reason). "pending: AREA": in an area another change is
# rewriting (issue 40), to be resolved there; an entry that matches nothing fails the test otherwise.
DUPLICATES_ALLOWED: dict[tuple[str, str], str] = {
    ("tests/e2e/test_structured_e2e.py", "tests/engine/test_structured.py"):
        "pending: tests/engine (the JSON schema both send; move it to tests/support)",
}


def _without_imports_and_signatures(source: str) -> str:
    """``source`` with every import statement and every function signature (``def`` line to the line before its
    body) turned into empty comment lines, the line numbers kept."""
    skipped: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            skipped.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            skipped.update(range(node.lineno, node.body[0].lineno))
    return "".join("#\n" if n in skipped else line for n, line in enumerate(source.splitlines(keepends=True), 1))


def _duplicate_pairs() -> dict[tuple[str, str], list[str]]:
    """``{(path, path): ["path:[start:end] ~ path:[start:end]", ...]}`` for each pair of files under
    ``DUPLICATE_ROOTS`` (migrations aside) sharing ``DUPLICATE_MIN_LINES`` or more lines, as Symilar reports them."""
    import contextlib
    import io
    import re

    from pylint.checkers.symilar import Symilar  # the test extra

    symilar = Symilar(min_lines=DUPLICATE_MIN_LINES, ignore_comments=True, ignore_docstrings=True)
    for path in _python_files(*DUPLICATE_ROOTS):
        source = _without_imports_and_signatures(path.read_text(encoding="utf-8"))
        symilar.append_stream(path.relative_to(ROOT).as_posix(), io.StringIO(source))
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        symilar.run()
    places = re.findall(r"^==(.+?):\[(\d+):(\d+)\]$", report.getvalue(), flags=re.MULTILINE)
    pairs: dict[tuple[str, str], list[str]] = {}
    for (a, a0, a1), (b, b0, b1) in zip(places[::2], places[1::2]):
        pairs.setdefault((min(a, b), max(a, b)), []).append(f"{a}:[{a0}:{a1}] ~ {b}:[{b0}:{b1}]")
    return pairs


def test_no_duplicate_code() -> None:
    """No two files share a run of ``DUPLICATE_MIN_LINES`` lines alike unless the pair is in ``DUPLICATES_ALLOWED``
    with its reason; no stale entry there."""
    pairs = _duplicate_pairs()
    new = [place for pair, places in sorted(pairs.items()) if pair not in DUPLICATES_ALLOWED for place in places]
    stale = [f"{a} ~ {b}" for (a, b), reason in DUPLICATES_ALLOWED.items()
             if (a, b) not in pairs and not reason.startswith("pending:")]
    assert not new, "code repeated (share it, or list the pair in DUPLICATES_ALLOWED with its reason):\n" + "\n".join(new)
    assert not stale, "DUPLICATES_ALLOWED entries that match nothing any more (remove them):\n" + "\n".join(stale)
