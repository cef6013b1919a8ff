"""Step 6 (DESIGN.md §2 step 6): input processing. The prompt ids and the validated request become ``n``
``EngineCoreRequest`` s (``inference.input_processor.process_inputs``: lengths vs ``max_model_len``, ids in the
vocabulary, sampling parameters, seeds ``seed + i``), with the caller's prefix-cache salt and its validated
structured-output constraint (``structured_constraint``, before the render)."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import replace

from typing import Any

from tenancy.selectors import AuthContext
from gateway.errors import bad_request
from gateway.model_cache import ModelSnapshot
from gateway.pipeline.failures import api_error_from
from inference.input_processor import (
    GenerationDefaults,
    ProcessedInput,
    generation_defaults,
    model_vocab_size,
    process_inputs,
)
from inference.chat_output import ChatOutputSpec, resolve_parser_name
from inference.protocol.openai import RequestValidationError
from inference.renderer.tokenizer_cache import LoadedTokenizer
from inference.tool_parsers.forced import ToolChoiceConstraint, tool_choice_constraint
from inference.structured import Constraint, resolve
from registry.backends import STRUCTURED_AFTER_REASONING


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


async def structured_constraint(req: Any, param_prefix: str = "") -> Constraint | None:
    """The request's structured-output constraint (``response_format`` / ``structured_outputs``), validated by
    llguidance in a worker thread (``inference.structured.resolve``: serialising and validating a schema takes
    up to milliseconds; results are cached by hash, so a repeated schema costs a lookup). ``None`` without one.
    ``ApiError`` 400 naming the field (``response_format.json_schema.schema``, ``structured_outputs.regex``, ...)
    for a constraint the library refuses or one over a cap (``param_prefix`` before it, see ``api_error_from``)."""
    if constraint_of_fields_absent(req):
        return None
    try:
        return await asyncio.to_thread(resolve, req)
    except RequestValidationError as exc:
        raise api_error_from(exc, param_prefix=param_prefix) from None


def constraint_of_fields_absent(req: Any) -> bool:
    """True when ``req`` asks for no constraint (no ``structured_outputs``; ``response_format`` absent or text):
    the common case skips the thread hop."""
    rf = getattr(req, "response_format", None)
    return getattr(req, "structured_outputs", None) is None and (rf is None or rf.type == "text")


def process(req: Any, model: ModelSnapshot, tokenizer: LoadedTokenizer, *, external_id: str, prompt_token_ids: list[int],
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
    if structured is None and not constraint_of_fields_absent(req):
        raise RuntimeError("a request with a structured-output constraint reached input processing unvalidated "
                           "(await structured_constraint first)")
    try:
        constraint: Constraint | ToolChoiceConstraint | None = structured
        if chat_output is not None:
            reasoning = chat_output.reasoning()
            end_ids = list(reasoning.end_token_ids) if reasoning is not None else []
            constraint = tool_choice_constraint(req, reasoning_end_ids=end_ids)
            if constraint is None and structured is not None:  # response_format / structured_outputs
                constraint = replace(structured, after_token_ids=tuple(end_ids))
            if (constraint is not None and constraint.after_token_ids
                    and STRUCTURED_AFTER_REASONING in model.unsupported_features):
                raise bad_request(
                    f"The model '{model.served_model_name}' is served by an engine backend that cannot start an "
                    "output constraint (response_format, structured_outputs, tool_choice 'required' or a named "
                    "tool) after the model's reasoning; turn thinking off (chat_template_kwargs "
                    '{"enable_thinking": false}) or drop the constraint',
                    "response_format" if structured is not None else "tool_choice")
        processed = process_inputs(
            req, external_id=external_id, prompt_token_ids=prompt_token_ids, prompt_param=prompt_param,
            max_model_len=model.max_model_len, vocab_size=vocab_size_of(tokenizer, model),
            defaults=defaults if defaults is not None else generation_defaults(model.model_dir),
            client_id=client_id, arrival_time=arrival_time, eos_token_ids=eos_ids_of(tokenizer),
            logprobs=logprobs, cache_salt=cache_salt, prompt_logprobs=prompt_logprobs, constraint=constraint)
    except RequestValidationError as exc:
        raise api_error_from(exc, param_prefix=param_prefix) from None
    processed.chat_output = chat_output
    return processed


def model_template_text(model: ModelSnapshot, tokenizer: LoadedTokenizer) -> str:
    """The served model's own chat template text (the registry override, else the tokenizer's templates, named
    ones included): what the ``auto`` parser choices are derived from."""
    if model.chat_template:
        return model.chat_template
    return "\n".join([tokenizer.chat_template or "", *tokenizer.chat_templates.values()])


def chat_output_spec(req: Any, model: ModelSnapshot, tokenizer: LoadedTokenizer,
                     prompt_token_ids: list[int]) -> ChatOutputSpec:
    """How the choices of chat request ``req`` are parsed on ``model`` (its registry ``reasoning_parser`` and
    ``tool_call_parser``, ``auto`` resolved from its template; ``inference.chat_output``)."""
    template = model_template_text(model, tokenizer)
    return ChatOutputSpec.for_request(
        req, tokenizer=tokenizer, prompt_token_ids=prompt_token_ids,
        reasoning_parser=resolve_parser_name(model.reasoning_parser, template, kind="reasoning"),
        tool_parser=resolve_parser_name(model.tool_call_parser, template, kind="tool"))


def attach_media(processed: ProcessedInput, rendered: dict[str, Any]) -> None:
    """Give every engine request of ``processed`` the image feature keys of ``rendered`` (no-op without)."""
    keys = list(rendered.get("mm_cache_keys") or [])
    if keys:
        for r in processed.requests:
            r.mm_cache_keys = keys
