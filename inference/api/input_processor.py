"""InputProcessor: prompt lengths and sampling parameters → ``EngineCoreRequest``(s).

Runs in the api process after render+tokenize and before admission (docs/ARCHITECTURE.md §2 step 8). Pure CPU
work on small inputs (no I/O), cheap enough for the event loop. Rules (vLLM's ``get_max_tokens`` in
``vllm/entrypoints/serve/utils/api_utils.py`` and ``vllm/v1/engine/input_processor.py``, conformance C11, C16, C17),
with one deliberate difference from vLLM 0.33: an explicit ``max_tokens`` that does not fit beside the prompt is
refused with the real numbers instead of being silently clamped (always ``prompt_len + max_tokens ≤
max_model_len``).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from inference.protocol.engine import EngineCoreRequest, SamplingParams
from inference.protocol.openai import RequestValidationError
from inference.shared.structured import Constraint


@dataclass(frozen=True)
class GenerationDefaults:
    """Server-side defaults read from a model's ``generation_config.json`` (vLLM ``--generation-config auto``).

    Values are ``None`` where the file is silent; ``eos_token_ids`` lists every EOS id it names.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    eos_token_ids: tuple[int, ...] = ()


@lru_cache(maxsize=64)
def _load_generation_defaults(path: str, mtime: float) -> GenerationDefaults:
    with open(path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    return GenerationDefaults(
        temperature=cfg.get("temperature") if cfg.get("do_sample", True) else None,
        top_p=cfg.get("top_p"),
        top_k=cfg.get("top_k"),
        min_p=cfg.get("min_p"),
        repetition_penalty=cfg.get("repetition_penalty"),
        max_new_tokens=cfg.get("max_new_tokens"),
        eos_token_ids=eos_ids,
    )


def generation_defaults(model_dir: str) -> GenerationDefaults:
    """Defaults of the model in ``model_dir`` (cached per file mtime); empty when there is no file."""
    path = os.path.join(model_dir, "generation_config.json")
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        return GenerationDefaults()
    return _load_generation_defaults(path, mtime)


@lru_cache(maxsize=64)
def _load_config_vocab(path: str, mtime: float) -> int | None:
    with open(path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    value = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return int(value) if value else None


def model_vocab_size(model_dir: str) -> int | None:
    """``vocab_size`` of the model's ``config.json`` (rows of its embedding), ``None`` when unknown."""
    path = os.path.join(model_dir, "config.json")
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        return None
    return _load_config_vocab(path, mtime)


@dataclass
class ProcessedInput:
    """The result of input processing for one API request.

    ``requests`` holds one ``EngineCoreRequest`` per choice (``n`` children, seeds ``seed + i``);
    ``constraint_param``: the field the request's output constraint came from (``response_format...``, ``tools``);
    ``max_tokens`` is the resolved output cap; ``external_id`` the id shown to the client; ``chat_output`` how a
    chat request's choices are parsed (``inference.api.chat_output.ChatOutputSpec``), set by the chat path.
    ``batch_prompts``: set for a batch of completions prompts (``merge_batch``): the prompts in order, the
    ``requests`` prompt by prompt; ``prompt_token_ids`` is then the first prompt.
    """

    external_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    requests: list[EngineCoreRequest] = field(default_factory=list)
    chat_output: Any = None
    batch_prompts: list[list[int]] | None = None
    constraint_param: str | None = None  # the request field of its output constraint (errors name it)

    @property
    def prompt_tokens_per_request(self) -> int:
        """Prompt tokens per engine request for admission (``n × this`` is reserved): the prompt's length, or in
        a batch the mean over its requests rounded up (the reservation then covers every prompt's children)."""
        if not self.requests:
            return len(self.prompt_token_ids)
        total = sum(len(r.prompt_token_ids) for r in self.requests)
        return -(-total // len(self.requests))


def merge_batch(parts: list[ProcessedInput]) -> ProcessedInput:
    """One ``ProcessedInput`` for a batch of completions prompts, from each prompt's own (``parts``, in prompt
    order, each with the same ``n``): the requests prompt by prompt, ``batch_prompts`` set. One part is returned
    as it is."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return ProcessedInput(external_id=first.external_id, prompt_token_ids=first.prompt_token_ids,
                          max_tokens=max(p.max_tokens for p in parts),
                          requests=[r for p in parts for r in p.requests],
                          batch_prompts=[p.prompt_token_ids for p in parts])


def new_internal_id(external_id: str) -> str:
    """``external_id + "-" + 8 random hex chars`` (vLLM ``InputProcessor.assign_request_id``)."""
    return f"{external_id}-{secrets.token_hex(4)}"


def check_prompt_tokens(prompt_token_ids: list[int], *, vocab_size: int, max_model_len: int,
                        prompt_param: str) -> None:
    """Validate prompt ids and length.

    Raises ``RequestValidationError`` when the prompt is empty, holds an id outside ``[0, vocab_size)``
    (the message names the id), is longer than ``max_model_len`` or fills it exactly (no room for one
    output token; the message says so rather than calling it longer, conformance C17).
    """
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestValidationError("The prompt is empty: it must contain at least one token", prompt_param)
    for tid in prompt_token_ids:
        if not 0 <= tid < vocab_size:
            raise RequestValidationError(
                f"Token id {tid} is out of vocabulary (valid ids are 0 to {vocab_size - 1})", prompt_param)
    if n > max_model_len:
        raise RequestValidationError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has {n} "
            f"input tokens. Please reduce the length of the input.", prompt_param)
    if n == max_model_len:
        raise RequestValidationError(
            f"The prompt has {n} tokens, which uses all {max_model_len} positions of this model's context "
            f"length and leaves no room for at least one output token. Please reduce the length of the "
            f"input.", prompt_param)


def resolve_max_tokens(*, prompt_len: int, max_model_len: int, requested: int | None, requested_param: str,
                       explicit: bool, default_cap: int | None) -> int:
    """Resolve the output cap.

    ``requested`` is the client's value (``explicit`` = the client sent it) or an endpoint default
    (completions: 16). Omitted on chat → the remaining context, further capped by the model's
    ``max_new_tokens`` default. An explicit value larger than the room left beside the prompt
    (``max_model_len - prompt_len``) raises ``RequestValidationError`` naming that field, in vLLM's words
    (``'max_tokens' or 'max_completion_tokens' is too large: N. This model's maximum context length is M tokens
    and your request has P input tokens (N > M - P)``, with the field actually used) plus the allowed maximum
    ``M - P``.
    """
    room = max_model_len - prompt_len
    if requested is None:
        value = room if default_cap is None else min(room, default_cap)
        return max(1, value)
    if requested > room:
        if explicit:
            raise RequestValidationError(
                f"'{requested_param}' is too large: {requested}. This model's maximum context length is "
                f"{max_model_len} tokens and your request has {prompt_len} input tokens ({requested} > "
                f"{max_model_len} - {prompt_len}): '{requested_param}' must be at most {room}.", requested_param)
        return room
    return requested


def build_sampling_params(req: Any, *, max_tokens: int, defaults: GenerationDefaults, vocab_size: int,
                          logprobs: int | None, prompt_logprobs: int | None = None,
                          constraint: Constraint | None = None) -> SamplingParams:
    """Merge request values over model defaults over OpenAI defaults into ``SamplingParams``.

    ``constraint``: the output constraint the gateway compiled (``inference.shared.structured.Constraint`` in its engine
    form: the request's ``response_format`` / ``structured_outputs``, or the schema a ``tool_choice`` required/named
    forces), copied to the structured fields; ``None``: unconstrained (a request's own constraint fields are never
    sent to an engine unchecked).

    Order per field (vLLM ``to_sampling_params``): request value → ``generation_config.json`` → OpenAI
    default. Raises ``RequestValidationError`` for ``logit_bias`` / ``stop_token_ids`` ids outside the
    vocabulary and ``min_tokens`` > ``max_tokens``.
    """
    def pick(value: Any, default: Any, fallback: Any) -> Any:
        if value is not None:
            return value
        return default if default is not None else fallback

    logit_bias: dict[int, float] = {}
    for key, bias in (req.logit_bias or {}).items():
        tid = int(key)
        if tid >= vocab_size:
            raise RequestValidationError(
                f"logit_bias token id {tid} is out of vocabulary (valid ids are 0 to {vocab_size - 1})",
                "logit_bias")
        logit_bias[tid] = float(bias)
    for tid in req.stop_token_ids or []:
        if tid >= vocab_size:
            raise RequestValidationError(
                f"stop_token_ids contains {tid}, which is out of vocabulary (valid ids are 0 to "
                f"{vocab_size - 1})", "stop_token_ids")
    if req.top_k is not None and req.top_k > vocab_size:
        raise RequestValidationError(
            f"top_k must be -1, 0 (disabled) or at most the vocabulary size {vocab_size}, got {req.top_k}", "top_k")
    min_tokens = req.min_tokens or 0
    if min_tokens > max_tokens:
        raise RequestValidationError(
            f"min_tokens ({min_tokens}) must be less than or equal to max_tokens ({max_tokens})", "min_tokens")
    temperature = float(pick(req.temperature, defaults.temperature, 1.0))
    greedy = temperature < 1e-5
    top_k = int(pick(req.top_k, defaults.top_k, 0))
    return SamplingParams(
        temperature=0.0 if greedy else temperature,
        top_p=1.0 if greedy else float(pick(req.top_p, defaults.top_p, 1.0)),
        top_k=0 if greedy or top_k < 0 else top_k,
        min_p=0.0 if greedy else float(pick(req.min_p, defaults.min_p, 0.0)),
        seed=None if req.seed in (None, -1) else int(req.seed),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=list(req.stop_token_ids or []),
        eos_token_ids=list(defaults.eos_token_ids),
        ignore_eos=bool(req.ignore_eos),
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        repetition_penalty=float(pick(req.repetition_penalty, defaults.repetition_penalty, 1.0)),
        logit_bias=logit_bias,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        vocab_size=vocab_size,
        structured_kind=constraint.kind if constraint is not None else None,
        structured_spec=constraint.spec if constraint is not None else "",
        structured_after_token_ids=list(constraint.after_token_ids) if constraint is not None else [],
    )


def process_inputs(req: Any, *, external_id: str, prompt_token_ids: list[int], prompt_param: str,
                   max_model_len: int, vocab_size: int, defaults: GenerationDefaults, client_id: str,
                   arrival_time: float | None = None, eos_token_ids: list[int] | None = None,
                   logprobs: int | None = None, cache_salt: str | None = None,
                   prompt_logprobs: int | None = None, constraint: Constraint | None = None) -> ProcessedInput:
    """Turn a validated chat/completion request plus its prompt ids into ``n`` ``EngineCoreRequest``s.

    ``logprobs`` / ``prompt_logprobs``: the engine's ``SamplingParams`` fields (top-k per generated / prompt
    token; ``None`` = none). Every child asks for the prompt logprobs (each choice's first output carries them).

    ``cache_salt`` goes on every request (the prefix-cache salt, see ``EngineCoreRequest.cache_salt``);
    ``constraint`` as in ``build_sampling_params``.

    ``eos_token_ids`` (the tokenizer's EOS) is used when the model's generation config names none.
    Raises ``RequestValidationError`` (HTTP 400) for every length, vocabulary or parameter error.
    """
    check_prompt_tokens(prompt_token_ids, vocab_size=vocab_size, max_model_len=max_model_len,
                        prompt_param=prompt_param)
    requested, param = req.requested_max_tokens
    explicit = param in req.model_fields_set and getattr(req, param) is not None
    max_tokens = resolve_max_tokens(
        prompt_len=len(prompt_token_ids), max_model_len=max_model_len, requested=requested,
        requested_param=param, explicit=explicit, default_cap=defaults.max_new_tokens)
    if not defaults.eos_token_ids and eos_token_ids:
        defaults = GenerationDefaults(**{**defaults.__dict__, "eos_token_ids": tuple(eos_token_ids)})
    params = build_sampling_params(req, max_tokens=max_tokens, defaults=defaults, vocab_size=vocab_size,
                                   logprobs=logprobs, prompt_logprobs=prompt_logprobs, constraint=constraint)
    n = req.n or 1
    arrival = arrival_time if arrival_time is not None else time.time()
    out = ProcessedInput(external_id=external_id, prompt_token_ids=prompt_token_ids, max_tokens=max_tokens)
    for i in range(n):
        child = SamplingParams(**{**params.__dict__})
        if params.seed is not None:
            child.seed = params.seed + i
        out.requests.append(EngineCoreRequest(
            request_id=new_internal_id(external_id) + (f"-{i}" if n > 1 else ""),
            external_req_id=external_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=child,
            client_id=client_id,
            arrival_time=arrival,
            cache_salt=cache_salt,
        ))
    return out
