"""The one reader of the environment for ``inference/`` (Django-free: the engine process, the Celery ``render`` and
``mm`` tasks and the gateway all import it; no other module under ``inference/`` reads ``os.environ``).

Read once, at import, into the frozen ``SETTINGS``; the modules that use a value keep a module-level name for it
(e.g. ``inference.workers.tasks.RENDER_TIME_LIMIT_S``). Every variable is optional; an unset or empty one takes its default.
The Django side reads its own settings in ``platform/config/settings.py`` (``tests/test_architecture.py`` checks
that nothing else reads the environment).

=================================  =======  ===================  ===========================================================
variable                           type     default              meaning (unit; read by)
=================================  =======  ===================  ===========================================================
``REDIS_URL``                      str      unset (``None``)     Redis of the platform; the engine falls back to
                                                                 ``redis://127.0.0.1:6379/0``, a render worker to Celery's
                                                                 result backend (``engine/__main__.py``, ``tasks.py``)
``ENGINE_LOG_LEVEL``               str      ``INFO``             the engine process's log level (``engine/__main__.py``)
``ENCODER_CACHE_MAX_BYTES``        int      268435456 (256 MiB)  bytes of vision-encoder outputs an engine keeps
                                                                 (``engine/encoder_cache.py``)
``ADMISSION_LEASE_TTL_S``          float    5                    seconds an admission reservation's lease lives without a
                                                                 refresh (``admission.py``)
``ADMISSION_LEASE_REFRESH_S``      float    1                    seconds between lease refreshes (``admission.py``)
``ADMISSION_RETRY_AFTER_MAX_S``    int      60                   largest ``Retry-After`` of an admission 503, seconds
                                                                 (``admission.py``)
``RENDER_TIME_LIMIT_S``            float    5                    soft time limit of a render task, seconds (``tasks.py``)
``RENDER_HARD_TIME_LIMIT_EXTRA_S`` float    2                    seconds past the soft limit before the worker child is
                                                                 killed (``tasks.py``)
``RENDER_MAX_OUTPUT_CHARS``        int      1048576              characters a chat template may output
                                                                 (``renderer/chat_template.py``)
``RENDER_MAX_OPS``                 int      200000               sandbox operations a chat template may run
                                                                 (``renderer/chat_template.py``, ``renderer/sandbox.py``)
``MM_TIME_LIMIT_S``                float    30                   soft time limit of an image (``mm``) task, seconds
                                                                 (``mm_tasks.py``)
``MM_URL_CACHE_TTL_S``             int      300                  seconds a fetched image URL's cache key is remembered
                                                                 (``renderer/multimodal.py``)
``MM_BLOB_TTL_S``                  int      120                  seconds image bytes wait in Redis for an ``mm`` worker
                                                                 (``renderer/multimodal.py``, the gateway's media step)
``MM_MAX_IMAGES_PER_REQUEST``      int      16                   images one request may carry (``renderer/multimodal.py``)
``MM_CACHE_MAX_BYTES``             int      536870912 (512 MiB)  bytes of image features in the Redis feature cache
                                                                 (``media/cache.py``)
``MM_MAX_IMAGE_PIXELS``            int      40000000             pixels of one decoded image (``media/image.py``)
``MM_MAX_IMAGE_SIDE``              int      16384                pixels of an image's longer side (``media/image.py``)
``MM_FETCH_TIMEOUT_S``             float    5                    deadline of one image URL fetch, seconds
                                                                 (``media/guard.py``)
``MM_FETCH_MAX_BYTES``             int      20971520 (20 MiB)    bytes of one fetched image (``media/guard.py``)
``MM_FETCH_MAX_REDIRECTS``         int      3                    redirects one fetch follows (``media/guard.py``)
``MM_FETCH_ALLOW_NETS``            str      unset (``None``)     comma-separated networks image fetches may reach besides
                                                                 public addresses (``media/guard.py:parse_allow_nets``)
``STRUCTURED_MAX_SPEC_BYTES``      int      65536                bytes of a structured-output constraint (schema, regex,
                                                                 choices, grammar) (``structured.py``)
``STRUCTURED_MAX_SCHEMA_DEPTH``    int      32                   nesting levels of a JSON schema (``structured.py``)
``STRUCTURED_MAX_CHOICES``         int      1024                 entries of ``structured_outputs.choice`` (``structured.py``)
``STRUCTURED_MAX_GRAMMAR_SIZE``    int      100000               llguidance grammar symbols (``structured.py``)
``STRUCTURED_MAX_LEXER_STATES``    int      50000                llguidance lexer states per grammar (``structured.py``)
``STRUCTURED_INITIAL_LEXER_FUEL``  int      100000               llguidance's fuel for a grammar's first mask (the lexer's
                                                                 precomputation) (``structured.py``)
``STRUCTURED_MAX_GRAMMAR_LINES``   int      4096                 lines of a ``structured_outputs.grammar`` (``structured_caps.py``)
``STRUCTURED_MAX_GRAMMAR_RULES``   int      512                  rule definitions of a grammar (``structured_caps.py``)
``STRUCTURED_MAX_NESTING``         int      64                   nested groups (parentheses) of a grammar or regular
                                                                 expression (``structured_caps.py``)
``STRUCTURED_MAX_SCHEMA_REFS``     int      512                  ``$ref`` s of a JSON schema (``structured_caps.py``)
``STRUCTURED_MAX_SCHEMA_DEFS``     int      512                  ``$defs`` / ``definitions`` entries of a JSON schema
                                                                 (``structured_caps.py``)
``STRUCTURED_COMPILE_CPU_S``       float    1                    CPU seconds one constraint's compile may use in the api's
                                                                 grammar sandbox process; past it: 400 (``structured_sandbox.py``)
``STRUCTURED_COMPILE_PROCESSES``   int      2                    grammar sandbox processes per api process
                                                                 (``structured_sandbox.py``)
``STRUCTURED_COMPILE_PER_TENANT``  int      1                    compiles of one tenant running at once in one api process's
                                                                 sandbox; more wait (``structured_sandbox.py``)
``STRUCTURED_COMPILE_MAX_BYTES``   int      1073741824 (1 GiB)   address space of a sandbox process (``structured_sandbox.py``)
``STRUCTURED_COMPILE_CACHE_SIZE``  int      1024                 compile results an api process keeps (LRU, per cache
                                                                 scope) (``structured_sandbox.py``)
``STRUCTURED_FAIR_SHARE_WEIGHT``   int      2                    requests a constrained request counts as in its tenant's
                                                                 fair share of the admission limits (``admission.py``)
``STRUCTURED_COMPILE_THREADS``     int      2                    engine threads compiling grammars
                                                                 (``engine/structured.py``)
``STRUCTURED_GRAMMAR_CACHE_SIZE``  int      256                  compiled grammars an engine keeps (LRU)
                                                                 (``engine/structured.py``)
``SEGMENT_CACHE_MAX_TOKENS``       int      4000000              token ids the per-process segment tokenization cache holds
                                                                 (LRU, 4 bytes each; 0 turns it off: whole-prompt encoding)
                                                                 (``renderer/segment_cache.py``)
``SEGMENT_CACHE_MIN_CHARS``        int      64                   characters a prompt segment needs to be cached
                                                                 (``renderer/segment_cache.py``)
``SEGMENT_CACHE_REDIS_MIN_CHARS``  int      1024                 characters a chat segment needs to be looked up in and
                                                                 written to the render workers' shared tier in Redis (0
                                                                 turns it off) (``renderer/segment_cache.py``, D-303)
``SEGMENT_CACHE_REDIS_TTL_S``      int      300                  seconds a shared-tier entry lives after it is written
``SEGMENT_CACHE_REDIS_URL``        str      unset (``None``)     a Redis of its own for the shared tier (e.g. one with
                                                                 ``maxmemory`` and ``allkeys-lru``); unset: the reply Redis
                                                                 (``REDIS_URL``, else Celery's result backend)
``ENGINE_ROUTING``                 str      ``prefix``           how an api process picks a generate request's replica:
                                                                 ``prefix`` (its own stream, chosen by prefix-cache hit
                                                                 against load) or ``shared`` (the model's shared stream,
                                                                 any replica pulls it) (``engine_client.py``, ``router.py``)
``OUTPUT_PARSER_MAX_HELD_CHARS``   int      262144               characters an output parser may hold back undecided: a
                                                                 tool call's markup and JSON longer than this is content,
                                                                 leading whitespace longer than this is released
                                                                 (``markers.py``: ``tool_parsers/``, ``reasoning/``,
                                                                 ``chat_output.py``)
=================================  =======  ===================  ===========================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

__all__ = ["InferenceSettings", "SETTINGS"]


def _str(env: Mapping[str, str], name: str) -> str | None:
    """``env[name]``, or ``None`` when unset or empty."""
    value = env.get(name)
    return value if value else None


def _parse(default: object, raw: str) -> object:
    """``raw`` as the type of the field whose default is ``default`` (int or float; anything else stays text)."""
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    return raw


@dataclass(frozen=True, slots=True)
class InferenceSettings:
    """The environment variables of ``inference/``, typed (names, defaults and units: the module docstring)."""

    redis_url: str | None = None
    engine_log_level: str = "INFO"
    encoder_cache_max_bytes: int = 256 * 1024 * 1024
    admission_lease_ttl_s: float = 5.0
    admission_lease_refresh_s: float = 1.0
    admission_retry_after_max_s: int = 60
    render_time_limit_s: float = 5.0
    render_hard_time_limit_extra_s: float = 2.0
    render_max_output_chars: int = 1 << 20
    render_max_ops: int = 200_000
    mm_time_limit_s: float = 30.0
    mm_url_cache_ttl_s: int = 300
    mm_blob_ttl_s: int = 120
    mm_max_images_per_request: int = 16
    mm_cache_max_bytes: int = 512 * 1024 * 1024
    mm_max_image_pixels: int = 40_000_000
    mm_max_image_side: int = 16384
    mm_fetch_timeout_s: float = 5.0
    mm_fetch_max_bytes: int = 20 * 1024 * 1024
    mm_fetch_max_redirects: int = 3
    mm_fetch_allow_nets: str | None = None
    structured_max_spec_bytes: int = 65536
    structured_max_schema_depth: int = 32
    structured_max_choices: int = 1024
    structured_max_grammar_size: int = 100_000
    structured_max_lexer_states: int = 50_000
    structured_initial_lexer_fuel: int = 100_000
    structured_max_grammar_lines: int = 4096
    structured_max_grammar_rules: int = 512
    structured_max_nesting: int = 64
    structured_max_schema_refs: int = 512
    structured_max_schema_defs: int = 512
    structured_compile_cpu_s: float = 1.0
    structured_compile_processes: int = 2
    structured_compile_per_tenant: int = 1
    structured_compile_max_bytes: int = 1 << 30
    structured_compile_cache_size: int = 1024
    structured_fair_share_weight: int = 2
    structured_compile_threads: int = 2
    structured_grammar_cache_size: int = 256
    segment_cache_max_tokens: int = 4_000_000
    segment_cache_min_chars: int = 64
    segment_cache_redis_min_chars: int = 1024
    segment_cache_redis_ttl_s: int = 300
    segment_cache_redis_url: str | None = None
    engine_routing: str = "prefix"
    output_parser_max_held_chars: int = 1 << 18

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> InferenceSettings:
        """Read every field from ``env`` (default ``os.environ``): the field's name upper-cased is the variable.

        Raises ``ValueError`` when a set variable does not parse as its field's type.
        """
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for name, default in cls._defaults().items():
            raw = _str(env, name.upper())
            if raw is None:
                continue
            values[name] = _parse(default, raw)
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def _defaults(cls) -> dict[str, object]:
        default = cls()
        return {name: getattr(default, name) for name in cls.__dataclass_fields__}


SETTINGS = InferenceSettings.from_env()


def set_engine_environ(values: Mapping[str, str]) -> None:
    """Set variables an engine library reads from the environment of its own process (vLLM's
    ``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND``, ``HF_HUB_OFFLINE``, ...) before it is imported;
    one the operator set already is kept (``inference.engine.vllm_backend``)."""
    for name, value in values.items():
        os.environ.setdefault(name, value)
