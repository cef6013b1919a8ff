"""Fixtures for the engine tests: the demo model, real Redis, real engine processes.

Nothing is mocked: the engine runs as ``python -m inference.engine`` in a subprocess against the
Redis at ``REDIS_URL`` (default ``redis://127.0.0.1:6379/3``) under a random link prefix that is
deleted afterwards.

``engine`` (and ``fresh_engine``) are parametrised over the engine backends: ``native`` (our engine) and
``vllm`` (vLLM's engine behind the same link, ``python -m inference.engine.vllm_backend`` run by vLLM's own
environment, ``.peer/vllm`` or ``$VLLM_PYTHON``; skipped when that environment is missing: ``scripts/setup.sh
--vllm``). The tests that go through the link run on both; a test of what only our engine does is marked
``native_only`` (the reason in the marker) and skipped on vLLM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgpack
import pytest
import redis

from tests.support.live import stop_in_background
from inference.protocol.engine import (
    api_alive_key,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    SamplingParams,
    control_stream,
    outputs_stream,
    replica_key,
    replica_requests_stream,
    requests_stream,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / ".cache" / "models" / "tiny-qwen3"
TOKENIZER_DIR = ROOT / ".cache" / "tokenizers" / "qwen3"
MODEL = "tiny-qwen3"
EOS_IDS = [151645, 151643]
VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON") or ROOT / ".peer" / "vllm" / "bin" / "python")
BACKENDS = ["native", "vllm"]


def pytest_configure(config):
    config.addinivalue_line("markers", "native_only(reason): a test of what only the native engine does")


@pytest.fixture(autouse=True)
def _native_only(request):
    """Skip a ``native_only`` test on the vLLM backend (its reason shows in the skip)."""
    marker = request.node.get_closest_marker("native_only")
    callspec = getattr(request.node, "callspec", None)
    if marker is not None and callspec is not None and callspec.params.get("backend") == "vllm":
        pytest.skip(f"native engine only: {marker.args[0] if marker.args else ''}")


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request) -> str:
    """The engine backend under test (``vllm`` skipped when vLLM's environment is missing)."""
    if request.param == "vllm" and not os.access(VLLM_PYTHON, os.X_OK):
        pytest.skip(f"vLLM backend: no vLLM environment at {VLLM_PYTHON} (scripts/setup.sh --vllm)")
    return request.param


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The demo model directory, built with scripts/build_demo_model.py when missing."""
    if not (MODEL_DIR / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build_demo_model.py"),
                        "--tokenizer-dir", str(TOKENIZER_DIR), "--out", str(MODEL_DIR)],
                       check=True, cwd=ROOT, timeout=300)
    return MODEL_DIR


@pytest.fixture(scope="session")
def redis_url() -> str:
    return os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/3")


@pytest.fixture(scope="session")
def link_prefix(redis_url):
    """A random link prefix; every key under it is deleted at the end of the session."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    yield prefix
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(f"{prefix}*", count=1000))  # the backends' own prefixes start with it
    if keys:
        r.delete(*keys)


class EngineProc:
    """A running engine subprocess plus helpers to talk to it over the real Redis link."""

    def __init__(self, redis_url: str, prefix: str, model_dir: Path, log_path: Path, *extra: str,
                 backend: str = "native"):
        self.r = redis.Redis.from_url(redis_url)
        self.prefix = prefix
        self.backend = backend
        self.engine_id = f"e{uuid.uuid4().hex[:6]}"
        self.client_id = f"c{uuid.uuid4().hex[:6]}"
        self.log_path = log_path
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        cmd = ([str(VLLM_PYTHON), "-m", "inference.engine.vllm_backend", "--kv-cache-gb", "1", "--dtype", "float32"]
               if backend == "vllm" else [sys.executable, "-m", "inference.engine"])
        self.proc = subprocess.Popen(
            [*cmd, "--model", MODEL, "--model-dir", str(model_dir),
             "--redis-url", redis_url, "--link-prefix", prefix, "--engine-id", self.engine_id, *extra],
            cwd=ROOT, env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        self._last = "0-0"
        try:
            self.wait_ready(timeout=900 if backend == "vllm" else 180)  # vLLM: ~30 s alone, minutes on a busy box
        except BaseException:
            self.stop(timeout=5)  # never leave an engine (and vLLM's engine-core process) behind
            raise

    @property
    def hb_key(self) -> str:
        return replica_key(self.prefix, MODEL, self.engine_id)

    def wait_ready(self, timeout: float = 180) -> None:  # torch import and load: a minute on a loaded 2-core box
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.r.exists(self.hb_key):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"engine did not start:\n{self.log_path.read_text()[-3000:]}")

    def stats(self) -> EngineStats | None:
        raw = self.r.get(self.hb_key)
        return EngineStats.from_wire(raw) if raw else None

    def send(self, prompt: list[int], request_id: str | None = None, priority: int = 0, routed: bool = False,
             **sampling) -> str:
        """XADD one EngineCoreRequest (of ``priority``: lower runs first) to the model's shared request stream, or
        with ``routed`` to this replica's own stream (as the api's router sends); returns its request id."""
        rid = request_id or f"req-{uuid.uuid4().hex[:8]}"
        sampling.setdefault("eos_token_ids", EOS_IDS)
        req = EngineCoreRequest(request_id=rid, external_req_id=rid, prompt_token_ids=prompt,
                                sampling_params=SamplingParams(**sampling), client_id=self.client_id,
                                arrival_time=time.time(), priority=priority)
        # like an api process, keep this client's liveness key fresh while it has requests in flight
        self.r.set(api_alive_key(self.prefix, self.client_id), b"1", ex=120)
        stream = replica_requests_stream(self.prefix, MODEL, self.engine_id) if routed else \
            requests_stream(self.prefix, MODEL)
        self.r.xadd(stream, {"r": req.to_wire()})
        return rid

    def abort(self, *request_ids: str) -> None:
        self.r.xadd(control_stream(self.prefix, MODEL), {"a": msgpack.packb(list(request_ids))})

    def read(self, timeout_ms: int = 200) -> list[EngineCoreOutputs]:
        """Read the next output messages of this client (may be empty)."""
        try:
            resp = self.r.xread({outputs_stream(self.prefix, self.client_id): self._last}, block=timeout_ms)
        except redis.exceptions.TimeoutError:  # a shared Redis on a loaded machine answered late: read again
            return []
        msgs = []
        for _stream, entries in resp or []:
            for entry_id, fields in entries:
                self._last = entry_id
                msgs.append(EngineCoreOutputs.from_wire(fields[b"o"]))
        return msgs

    def collect(self, request_ids, timeout: float = 120, until_first_token: bool = False,
                seen: dict[str, list] | None = None) -> dict:
        """Outputs per request id until every one has finished (or produced a token when
        ``until_first_token``). ``seen``: outputs an earlier collect already read, by request id; they come first and
        count (one read returns everything sent since the last, so an ``until_first_token`` collect may hold a
        request's end). Raises ``TimeoutError`` when that takes longer than ``timeout``."""
        want = set(request_ids)
        got: dict[str, list] = {rid: list((seen or {}).get(rid, [])) for rid in want}
        deadline = time.time() + timeout
        while time.time() < deadline:
            for msg in self.read():
                for out in msg.outputs:
                    if out.request_id in got:
                        got[out.request_id].append(out)
            done = {rid for rid, outs in got.items()
                    if any(o.finish_reason for o in outs)
                    or (until_first_token and any(o.new_token_ids for o in outs))}
            if done >= want:
                return got
        # what a hang needs to be told apart: how far each one got, what the engine says it holds, its log's end
        progress = {rid: sum(len(o.new_token_ids) for o in got[rid]) for rid in want - done}
        log_tail = self.log_path.read_text(errors="replace")[-3000:]
        raise TimeoutError(f"unfinished (tokens so far): {progress}; engine stats: {self.stats()}; "
                           f"engine alive: {self.proc.poll() is None}; engine log:\n{log_tail}")

    def stop(self, timeout: float = 20) -> int:
        """SIGTERM the engine, SIGKILL it after ``timeout``, then whatever is left of its process group (vLLM's
        engine-core process); its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        deadline = time.time() + 10
        while time.time() < deadline:  # the engine's own children get a moment to leave on their own
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.proc.returncode


@pytest.fixture(scope="session")
def engine(backend, redis_url, link_prefix, model_dir, tmp_path_factory):
    """One shared engine per backend (max_num_seqs 8, max_model_len 512, step watchdog 30 s) for most tests; each
    backend has its own link prefix, so the two never share a request stream. The native engine's step budget of 32
    tokens makes every prompt longer than that go through chunked prefill (prefix cache, prompt logprobs, penalties and
    so on)."""
    log = tmp_path_factory.mktemp(f"engine-{backend}") / "engine.log"
    budget = ["--max-num-batched-tokens", "32"] if backend == "native" else []
    # a step loop that stalls 30 s is a defect in any test here: the replica then exits with its stack in the log
    # (which a collect's timeout prints) instead of hanging until the test's own timeout
    eng = EngineProc(redis_url, f"{link_prefix}{backend[0]}", model_dir, log, "--max-num-seqs", "8",
                     "--max-model-len", "512", "--step-watchdog-s", "30", *budget, backend=backend)
    yield eng

    def stop_and_clear() -> None:
        # then what the replica and this client left under the prefix (this client's outputs stream has no TTL)
        eng.stop()
        keys = list(eng.r.scan_iter(f"{eng.prefix}:*", count=1000))
        if keys:
            eng.r.delete(*keys)

    stop_in_background(f"{backend} engine", stop_and_clear)


@pytest.fixture
def fresh_engine(backend, redis_url, link_prefix, model_dir, tmp_path):
    """A private engine for tests that stop it; its own link prefix keeps queues apart."""
    prefix = f"{link_prefix}x{backend[0]}"
    eng = EngineProc(redis_url, prefix, model_dir, tmp_path / "engine.log", backend=backend)
    yield eng
    eng.stop()
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(f"{prefix}:*", count=1000))
    if keys:
        r.delete(*keys)
