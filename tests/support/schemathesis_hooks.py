"""schemathesis hooks for ``tests/e2e/test_schemathesis_e2e.py`` (loaded by the CLI through ``SCHEMATHESIS_HOOKS``).

* ``ST_PROTECTED_KEY_ID``: the id of the API key the run authenticates with. A generated ``/api/v1/keys/{id}``
  case naming it is dropped: a key may revoke itself (tenancy.services), which would leave the rest of the run
  answering 401.
* ``ST_SERVED_MODEL``: a served model name put into every other generated body that names a ``model`` (chosen by
  a checksum of the body, so a seed gives the same cases), so the OpenAI routes run their whole path, not only
  the 404 of a made-up model. A body naming that model (put there, or taken by schemathesis from an answer) has
  its ``max_tokens`` (``sampling_params.max_tokens`` on generate) held to 1..``MAX_TOKENS`` and ``n`` to at most
  ``MAX_N``: left out, ``max_tokens`` means the whole context (511 tokens on the e2e platform: 33 s on a loaded
  2-core machine, past the run's 30 s request timeout).
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import schemathesis

MAX_TOKENS = 8
MAX_N = 4


def _bounded(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with ``max_tokens`` in 1..MAX_TOKENS (``max_completion_tokens`` dropped) and ``n`` at most
    ``MAX_N``."""
    out = {k: v for k, v in params.items() if k != "max_completion_tokens"}
    max_tokens = out.get("max_tokens")
    if not (type(max_tokens) is int and 1 <= max_tokens <= MAX_TOKENS):
        out["max_tokens"] = MAX_TOKENS
    if type(out.get("n")) is int and out["n"] > MAX_N:
        out["n"] = MAX_N
    return out


@schemathesis.hook
def filter_case(context: Any, case: Any) -> bool:
    protected = os.environ.get("ST_PROTECTED_KEY_ID")
    params = case.path_parameters or {}
    return not (protected and str(params.get("id")) == protected)


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    model = os.environ.get("ST_SERVED_MODEL")
    if not (model and isinstance(body, dict) and isinstance(body.get("model"), str)):
        return body
    if body["model"] != model:  # schemathesis also reuses the name from earlier answers
        if zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode()) % 2:
            return body
        body = {**body, "model": model}
    if isinstance(body.get("token_ids"), list):  # generate: the sampling parameters are nested
        params = body.get("sampling_params")
        return {**body, "sampling_params": _bounded(params if isinstance(params, dict) else {})}
    return _bounded(body)
