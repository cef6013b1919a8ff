"""Step 8 (docs/ARCHITECTURE.md §2): input processing. The prompt ids and the validated request become ``n``
``EngineCoreRequest`` s (``inference.api.input_processor.process_inputs``: lengths vs ``max_model_len``, ids in the
vocabulary, sampling parameters, seeds ``seed + i``), with the caller's prefix-cache salt and its validated
structured-output constraint (``structured_constraint``, before the render)."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import replace
from typing import Protocol

from tenancy.selectors import AuthContext
from django.conf import settings

from gateway.errors import ErrorCode, bad_request, unavailable
from gateway.clients import background, redis
from gateway.model_cache import ModelSnapshot
from gateway.pipeline.failures import api_error_from
from inference.api.input_processor import (
    GenerationDefaults,
    ProcessedInput,
    generation_defaults,
    model_vocab_size,
    process_inputs,
)
from inference.api.chat_output import ChatOutputSpec, resolve_parser_name
from inference.protocol.openai import ChatCompletionRequest, RequestValidationError, StructuredOutputs
from inference.renderer.tokenizer_cache import LoadedTokenizer
from inference.api import structured_sandbox
from inference.tool_parsers.forced import tool_choice_constraint
from inference.shared.structured import Constraint, constraint_of, spec_key
from inference.shared.structured_caps import StructuredSpecError, check_size
from registry.backends import STRUCTURED_AFTER_REASONING


class SamplingRequest(Protocol):
    """What input processing reads of a validated request (``inference.api.input_processor.process_inputs``) and what
    the constraint checks read: a ``ChatCompletionRequest``, a ``CompletionRequest`` or ``/inference/v1/generate``'s
    ``GenerateSamplingParams``. A chat request's ``response_format``, ``tools`` and ``tool_choice`` are read when
    present (``inference.shared.structured.constraint_of``, ``tool_choice_constraint``)."""

    @property
    def n(self) -> int | None: ...
    @property
    def temperature(self) -> float | None: ...
    @property
    def top_p(self) -> float | None: ...
    @property
    def top_k(self) -> int | None: ...
    @property
    def min_p(self) -> float | None: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def min_tokens(self) -> int | None: ...
    @property
    def stop_token_ids(self) -> list[int] | None: ...
    @property
    def ignore_eos(self) -> bool | None: ...
    @property
    def presence_penalty(self) -> float | None: ...
    @property
    def frequency_penalty(self) -> float | None: ...
    @property
    def repetition_penalty(self) -> float | None: ...
    @property
    def logit_bias(self) -> dict[str, float] | None: ...
    @property
    def structured_outputs(self) -> StructuredOutputs | None: ...
    @property
    def model_fields_set(self) -> set[str]: ...
    @property
    def requested_max_tokens(self) -> tuple[int | None, str]: ...


def cache_salt_for(ctx: AuthContext, request_salt: str | None = None) -> str:
    """The cache salt of a request: 64 hex characters, SHA-256 over the caller's cache scope
    (``AuthContext.cache_scope``: its tenant, or the operator-set cache group it shares) and, when given, the
    request's own ``cache_salt`` (vLLM's field, which narrows sharing further; it never replaces the tenant
    part). Carried as ``EngineCoreRequest.cache_salt`` into the first prefix-cache block hash, and mixed into
    the image feature-cache keys, so cached prefixes and image features are shared only within one scope
    (and one request salt) and ``cached_tokens`` tells a caller nothing about other tenants' prompts."""
    h = hashlib.sha256(b"llmp-cache-salt\x00" + ctx.cache_scope.encode())
    if request_salt:
        h.update(b"\x00request:" + request_salt.encode())
    return h.hexdigest()


def vocab_size_of(tokenizer: LoadedTokenizer, model: ModelSnapshot) -> int:
    """Valid prompt ids are ``[0, this)``: ids the tokenizer can decode (added tokens included) that the
    model's embedding also has rows for."""
    model_vocab = model_vocab_size(model.model_dir)
    return min(int(tokenizer.vocab_size), model_vocab) if model_vocab else int(tokenizer.vocab_size)


def eos_ids_of(tokenizer: LoadedTokenizer) -> list[int]:
    """The tokenizer's EOS id as a list (empty when it has none)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else []


async def structured_constraint(req: SamplingRequest, ctx: AuthContext, param_prefix: str = "") -> Constraint | None:
    """The request's output constraint (``response_format`` / ``structured_outputs``, or the schema a ``tool_choice``
    required/named forces), compiled into its engine form in this process's grammar sandbox
    (``inference.api.structured_sandbox``: worker processes, a CPU-time budget per compile, a few compiles per tenant at
    once, results cached per cache scope). ``None`` without one. Serialising and sizing the constraint runs in a
    thread (linear in the body); nothing of the grammar work runs in this process.

    Raises ``ApiError`` 400 naming the field (``response_format.json_schema.schema``, ``structured_outputs.regex``,
    ``tools[0].function.parameters``, ...; ``param_prefix`` before it, see ``api_error_from``) for a constraint over
    a cap, one the library refuses, or one whose compile exceeded its budget; 503 when the sandbox cannot run."""
    if constraint_of_fields_absent(req) and not forces_tool_call(req):
        return None
    try:
        constraint, key = await asyncio.to_thread(_requested, req, ctx.cache_scope)
    except RequestValidationError as exc:
        raise api_error_from(exc, param_prefix=param_prefix) from None
    if constraint is None:
        return None
    try:
        result = await structured_sandbox.sandbox().compile(constraint.kind, constraint.spec, key=key,
                                                            tenant=str(ctx.tenant_id))
    except structured_sandbox.SandboxUnavailable as exc:
        raise unavailable(f"The output constraint cannot be checked right now ({exc}); retry shortly",
                          code=ErrorCode.STRUCTURED_OUTPUTS_UNAVAILABLE) from None
    if not result.cached:
        record_compile(result)
    if result.error is not None:
        raise api_error_from(constraint.refusal(result.error), param_prefix=param_prefix) from None
    return replace(constraint, spec=result.value())


def _requested(req: SamplingRequest, scope: str) -> tuple[Constraint | None, str]:
    """In a thread: the request's constraint as the client sent it (the ``tool_choice`` one, else
    ``constraint_of``) and its cache key for ``scope``; over the byte cap → ``RequestValidationError`` naming the field."""
    # first: it refuses a forced tool call beside another constraint
    forced = tool_choice_constraint(req) if forces_tool_call(req) else None
    constraint = forced or constraint_of(req)
    if constraint is None:
        return None, ""
    try:
        check_size(constraint.spec)
    except StructuredSpecError as exc:
        raise constraint.refusal(str(exc)) from None
    return constraint, spec_key(constraint.kind, constraint.spec, scope)


def record_compile(result: structured_sandbox.CompileResult) -> None:
    """Count a sandbox compile in Redis for ``/metrics`` (``structured_compiles_total{outcome}``,
    ``structured_compile_cpu_seconds_total``), in the background: a lost count never fails a request."""
    async def write() -> None:
        pipe = redis().pipeline(transaction=False)
        key = structured_sandbox.counters_key(settings.LINK_PREFIX)
        pipe.hincrby(key, result.outcome, 1)
        pipe.hincrbyfloat(key, "cpu_s", result.cpu_s)
        await pipe.execute()

    background(write(), "count a grammar compile")


def asks_for_constraint(req: SamplingRequest) -> bool:
    """True when ``req`` asks for an output constraint of any kind (``response_format`` json, ``structured_outputs``,
    a forced ``tool_choice``): a field check, no parsing."""
    return not constraint_of_fields_absent(req) or forces_tool_call(req)


def forces_tool_call(req: SamplingRequest) -> bool:
    """True when a chat request's ``tool_choice`` is ``"required"`` or names a function (a constraint)."""
    choice = getattr(req, "tool_choice", None)
    return choice == "required" or isinstance(choice, dict)


def constraint_of_fields_absent(req: SamplingRequest) -> bool:
    """True when ``req`` asks for no constraint (no ``structured_outputs``; ``response_format`` absent or text):
    the common case skips the thread hop."""
    rf = getattr(req, "response_format", None)
    return getattr(req, "structured_outputs", None) is None and (rf is None or rf.type == "text")


def process(req: SamplingRequest, model: ModelSnapshot, tokenizer: LoadedTokenizer, *, external_id: str, prompt_token_ids: list[int],
            prompt_param: str, client_id: str, arrival_time: float | None, logprobs: int | None, cache_salt: str,
            defaults: GenerationDefaults | None = None, param_prefix: str = "",
            prompt_logprobs: int | None = None, structured: Constraint | None = None,
            chat_output: ChatOutputSpec | None = None) -> ProcessedInput:
    """``process_inputs`` for ``req`` on ``model`` (its ``generation_config.json`` defaults unless ``defaults``
    is given); ``ApiError`` 400 naming the field (``param_prefix`` before it, see ``api_error_from``).
    ``structured``: the constraint ``structured_constraint`` validated (a request that asks for one and comes
    without it is refused here rather than sent unvalidated). ``chat_output`` (a chat request's output parsing)
    adds the ``tool_choice`` constraint (required/named), makes a thinking model's constraint start after its
    reasoning, and is kept on the result for the response."""
    if structured is None and not (constraint_of_fields_absent(req) and not forces_tool_call(req)):
        raise RuntimeError("a request with an output constraint reached input processing unvalidated "
                           "(await structured_constraint first)")
    try:
        constraint = structured
        if chat_output is not None and constraint is not None:
            reasoning = chat_output.reasoning()
            end_ids = tuple(reasoning.end_token_ids) if reasoning is not None else ()
            constraint = replace(constraint, after_token_ids=end_ids)
            if end_ids and STRUCTURED_AFTER_REASONING in model.unsupported_features:
                raise bad_request(
                    f"The model '{model.served_model_name}' is served by an engine backend that cannot start an "
                    "output constraint (response_format, structured_outputs, tool_choice 'required' or a named "
                    "tool) after the model's reasoning; turn thinking off (chat_template_kwargs "
                    '{"enable_thinking": false}) or drop the constraint',
                    "tool_choice" if constraint.param.startswith("tools") else constraint.param.split(".")[0])
        processed = process_inputs(
            req, external_id=external_id, prompt_token_ids=prompt_token_ids, prompt_param=prompt_param,
            max_model_len=model.max_model_len, vocab_size=vocab_size_of(tokenizer, model),
            defaults=defaults if defaults is not None else generation_defaults(model.model_dir),
            client_id=client_id, arrival_time=arrival_time, eos_token_ids=eos_ids_of(tokenizer),
            logprobs=logprobs, cache_salt=cache_salt, prompt_logprobs=prompt_logprobs, constraint=constraint)
    except RequestValidationError as exc:
        raise api_error_from(exc, param_prefix=param_prefix) from None
    processed.chat_output = chat_output
    processed.constraint_param = constraint.param if constraint is not None else None
    return processed


def model_template_text(model: ModelSnapshot, tokenizer: LoadedTokenizer) -> str:
    """The served model's own chat template text (the registry override, else the tokenizer's templates, named
    ones included): what the ``auto`` parser choices are derived from."""
    if model.chat_template:
        return model.chat_template
    return "\n".join([tokenizer.chat_template or "", *tokenizer.chat_templates.values()])


def chat_output_spec(req: ChatCompletionRequest, model: ModelSnapshot, tokenizer: LoadedTokenizer,
                     prompt_token_ids: list[int]) -> ChatOutputSpec:
    """How the choices of chat request ``req`` are parsed on ``model`` (its registry ``reasoning_parser`` and
    ``tool_call_parser``, ``auto`` resolved from its template; ``inference.api.chat_output``)."""
    template = model_template_text(model, tokenizer)
    return ChatOutputSpec.for_request(
        req, tokenizer=tokenizer, prompt_token_ids=prompt_token_ids,
        reasoning_parser=resolve_parser_name(model.reasoning_parser, template, kind="reasoning"),
        tool_parser=resolve_parser_name(model.tool_call_parser, template, kind="tool"))


def attach_media(processed: ProcessedInput, mm_cache_keys: list[str]) -> None:
    """Give every engine request of ``processed`` the image feature keys ``mm_cache_keys`` (a rendered chat's, in
    order; no-op without)."""
    keys = list(mm_cache_keys)
    if keys:
        for r in processed.requests:
            r.mm_cache_keys = keys
