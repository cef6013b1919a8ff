"""OpenAI ``logprobs`` objects from engine logprob entries.

Engine entries are ``[sampled_logprob, [[token_id, logprob], ...]]`` per generated token
(``inference.protocol.engine.EngineCoreOutput.new_logprobs``). Token strings keep their leading spaces
(decoded one id at a time without skipping special tokens); non-finite values are clamped to -9999.0 as
vLLM does, so the JSON stays valid.
"""

from __future__ import annotations

import math
from typing import Any

from inference.renderer.tokenizer_cache import LoadedTokenizer

FLOOR = -9999.0


def _finite(value: float | None) -> float:
    return FLOOR if value is None or not math.isfinite(value) else max(float(value), FLOOR)


def generate_logprobs(token_ids: list[int], entries: list[Any]) -> dict[str, Any]:
    """``/inference/v1/generate``'s ``logprobs``: ``{"content": [{"token_id", "logprob", "top_logprobs":
    [{"token_id", "logprob"}, ...]}, ...]}``, one per token with an entry (ids only: the route is tokens in, tokens
    out)."""
    content = []
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            continue
        content.append({"token_id": tid, "logprob": _finite(entry[0]),
                        "top_logprobs": [{"token_id": int(i), "logprob": _finite(lp)} for i, lp in (entry[1] or [])]})
    return {"content": content}


def token_text(tokenizer: LoadedTokenizer, token_id: int) -> str:
    """The text of one token id, leading space kept (may be U+FFFD for a partial UTF-8 byte)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: LoadedTokenizer, token_ids: list[int], entries: list[Any],
                  top_n: int) -> dict[str, Any] | None:
    """Chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}``."""
    content = []
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            continue
        sampled, top = entry[0], entry[1] if len(entry) > 1 else []
        text = token_text(tokenizer, tid)
        content.append({
            "token": text, "logprob": _finite(sampled), "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := token_text(tokenizer, int(i))), "logprob": _finite(lp),
                 "bytes": list(t.encode("utf-8"))}
                for i, lp in (top or [])[:top_n]
            ],
        })
    return {"content": content}


def completion_logprobs(tokenizer: LoadedTokenizer, token_ids: list[int], entries: list[Any],
                        text_offset0: int = 0) -> dict[str, Any]:
    """Legacy completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset0
    for tid, entry in zip(token_ids, entries):
        text = token_text(tokenizer, tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_finite(entry[0]))
        top = {token_text(tokenizer, int(i)): _finite(lp) for i, lp in (entry[1] or [])}
        top.setdefault(text, _finite(entry[0]))  # OpenAI: the sampled token is always listed (k + 1 at most)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
