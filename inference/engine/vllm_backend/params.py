"""Our link's wire types ↔ vLLM's request and output fields, as plain data (importable without vLLM).

``tokens_prompt`` turns an ``EngineCoreRequest`` into vLLM's prompt dict (token ids and the cache salt);
``sampling_kwargs`` turns our ``SamplingParams`` into the keyword arguments of ``vllm.SamplingParams``;
``logprob_entries`` / ``prompt_logprob_entries`` turn vLLM's per-position ``{token_id: Logprob}`` maps into our
``[sampled_logprob, [[token_id, logprob], ...top-k]]`` entries; ``stop_reason_of`` maps a finish back.
Semantics of both sides: ``inference.protocol.engine.SamplingParams`` and vLLM's ``vllm/sampling_params.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from inference.protocol.engine import STRUCTURED_KINDS, EngineCoreRequest, SamplingParams
from inference.shared.structured_caps import LARK_HEADER


class UnsupportedRequestError(ValueError):
    """A request this backend cannot serve as asked (fails only that request; the gateway refuses these with a
    400 before they reach an engine, see ``registry.backends``)."""


def tokens_prompt(req: EngineCoreRequest) -> dict[str, Any]:
    """The fields of vLLM's ``TokensPrompt`` (``vllm/inputs/llm.py``, a ``TypedDict``) for ``req``:
    ``prompt_token_ids`` (list of int) and, when ``req.cache_salt`` is a non-empty string, ``cache_salt``.

    The salt is the gateway's per-cache-scope one (``gateway.pipeline.inputs.cache_salt_for``: the tenant or its
    cache group, and the request's own ``cache_salt``). vLLM mixes it into the hash of a prompt's first KV block
    only, and only when non-empty (``generate_block_hash_extra_keys`` in ``vllm/v1/core/kv_cache_utils.py``), as
    our engine does (``inference.shared.prefix_hash.block_hashes``): so on both backends prefix-cache blocks, and the
    ``cached_tokens`` a caller sees, are shared only within one scope. ``None`` or ``""``: unsalted on both.
    """
    prompt: dict[str, Any] = {"prompt_token_ids": req.prompt_token_ids}
    if req.cache_salt:
        prompt["cache_salt"] = req.cache_salt
    return prompt


def sampling_kwargs(sp: SamplingParams, *, vocab_size: int) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for ``sp`` (one child: ``n=1``).

    EOS: vLLM stops on the tokenizer's own EOS and the generation config's ids unless ``ignore_eos``; ours are
    explicit (``sp.eos_token_ids``, chosen by the gateway), so vLLM's are switched off (``ignore_eos=True``) and ours
    are added to ``stop_token_ids`` (vLLM masks those below ``min_tokens`` too; ``stop_reason_of`` reports an EOS
    finish without a stop reason, as the native engine does). Under a structured-output constraint the grammar allows
    EOS only once the structure is complete, and such an EOS ends the output even with ``ignore_eos`` or
    ``min_tokens`` (as on the native engine): the EOS ids stay stop ids and ``min_tokens`` is not passed (vLLM's
    would mask the one token the grammar allows; so under a constraint it does not hold back ``stop_token_ids``
    either). ``sp.vocab_size`` (ids the served tokenizer can
    decode, below the model's ``vocab_size``): the ids past it get a ``-inf`` bias. Structured outputs go in
    ``structured_outputs`` (``structured_outputs_kwargs``; the caller wraps them in ``StructuredOutputsParams``).
    Raises ``UnsupportedRequestError`` for a constraint that starts after reasoning.
    """
    constrained = sp.structured_kind is not None
    stop_ids = list(sp.stop_token_ids)
    if not sp.ignore_eos or constrained:
        stop_ids += [t for t in sp.eos_token_ids if t not in sp.stop_token_ids]
    bias: dict[int, float] = {int(k): float(v) for k, v in sp.logit_bias.items()}
    if 0 < sp.vocab_size < vocab_size:
        for t in range(sp.vocab_size, vocab_size):
            bias[t] = float("-inf")
    kw: dict[str, Any] = {
        "n": 1,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k if sp.top_k > 0 else 0,
        "min_p": sp.min_p,
        "seed": sp.seed,
        "presence_penalty": sp.presence_penalty,
        "frequency_penalty": sp.frequency_penalty,
        "repetition_penalty": sp.repetition_penalty,
        "max_tokens": sp.max_tokens,
        "min_tokens": 0 if constrained else sp.min_tokens,
        "stop_token_ids": stop_ids,
        "ignore_eos": True,
        "logit_bias": bias or None,
        "logprobs": sp.logprobs,
        "prompt_logprobs": sp.prompt_logprobs,
        "detokenize": False,  # token ids out; the api process detokenizes (stop strings included)
        "skip_special_tokens": False,
    }
    so = structured_outputs_kwargs(sp)
    if so is not None:
        kw["structured_outputs"] = so
    return kw


def structured_outputs_kwargs(sp: SamplingParams) -> dict[str, Any] | None:
    """Keyword arguments of vLLM's ``StructuredOutputsParams`` for ``sp``'s constraint, ``None`` without one.

    ``json`` → ``json`` (the schema, parsed), ``json_object`` → ``json_object=True``, ``regex`` → ``regex``,
    ``choice`` → ``choice`` (the list), ``grammar`` (the engine form: Lark headed ``%llguidance {}``, which vLLM's
    format sniffing recognises at its first character) → ``grammar``. Raises ``UnsupportedRequestError`` for
    an unknown kind, a malformed spec, or ``structured_after_token_ids`` (vLLM sets up reasoning-aware constraints
    per engine, not per request).
    """
    kind = sp.structured_kind
    if kind is None:
        return None
    if kind not in STRUCTURED_KINDS:
        raise UnsupportedRequestError(f"unknown structured_kind {kind!r}")
    if sp.structured_after_token_ids:
        raise UnsupportedRequestError("this engine backend cannot start an output constraint after the reasoning")
    try:
        if kind == "json":
            return {"json": json.loads(sp.structured_spec)}
        if kind == "json_object":
            return {"json_object": True}
        if kind == "regex":
            return {"regex": sp.structured_spec}
        if kind == "choice":
            choices = json.loads(sp.structured_spec)
            if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
                raise UnsupportedRequestError("a choice constraint is a JSON list of strings")
            return {"choice": choices}
        if not sp.structured_spec.startswith(LARK_HEADER):  # vLLM would convert it here, in Python, on the loop
            raise UnsupportedRequestError("a grammar constraint must be the gateway's engine form (Lark, first line "
                                          f"{LARK_HEADER!r}); GBNF is converted by the gateway")
        return {"grammar": sp.structured_spec}
    except json.JSONDecodeError as exc:
        raise UnsupportedRequestError(f"malformed {kind} constraint: {exc}") from None


def stop_reason_of(sp: SamplingParams, stop_reason: object) -> int | None:
    """Our ``stop_reason`` for vLLM's: the stop token id, ``None`` when the token was one of ``sp``'s EOS ids
    (an EOS finish, as the native engine reports it) or vLLM gave none or a stop string."""
    if not isinstance(stop_reason, int) or isinstance(stop_reason, bool):
        return None
    if (not sp.ignore_eos or sp.structured_kind is not None) and stop_reason in sp.eos_token_ids:
        return None  # the native engine checks EOS first (and a complete grammar's EOS ends it whatever ignore_eos)
    return stop_reason if stop_reason in sp.stop_token_ids else None


def _value(lp: Any) -> float:
    """A ``Logprob``'s value (vLLM's dataclass with ``logprob``), or a bare float."""
    return float(getattr(lp, "logprob", lp))


def logprob_entry(token_id: int, logprobs: Mapping[int, Any], k: int) -> list[Any]:
    """Our entry ``[sampled_logprob, [[token_id, logprob], ...top k, descending]]`` from vLLM's map of one position
    (the sampled token plus the top ``k``, keyed by token id)."""
    top = sorted(((int(t), _value(lp)) for t, lp in logprobs.items()), key=lambda p: -p[1])
    sampled = logprobs.get(token_id)
    return [_value(sampled) if sampled is not None else top[0][1], [[t, v] for t, v in top[:k]]]


def logprob_entries(token_ids: list[int], positions: list[Mapping[int, Any]] | None,
                    k: int | None) -> list[Any] | None:
    """One ``logprob_entry`` per new token (``None`` when logprobs were not asked for or none came)."""
    if k is None or not positions:
        return None
    return [logprob_entry(t, m, k) for t, m in zip(token_ids, positions)]


def prompt_logprob_entries(prompt_token_ids: list[int], positions: list[Mapping[int, Any] | None] | None,
                           k: int | None) -> list[Any] | None:
    """Our ``prompt_logprobs`` (``None`` for the first prompt token, then one ``logprob_entry`` per token) from
    vLLM's list (``None`` first, then a map per position)."""
    if k is None or positions is None:
        return None
    out: list[Any] = []
    for i, t in enumerate(prompt_token_ids):
        m = positions[i] if i < len(positions) else None
        out.append(None if i == 0 or not m else logprob_entry(t, m, k))
    return out
