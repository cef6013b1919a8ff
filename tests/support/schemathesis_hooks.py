"""schemathesis hooks for ``tests/e2e/test_schemathesis_e2e.py`` (loaded by the CLI through ``SCHEMATHESIS_HOOKS``).

* ``ST_PROTECTED_KEY_ID``: the id of the API key the run authenticates with. A generated ``/api/v1/keys/{id}``
  case naming it is dropped: a key may revoke itself (tenancy.services), which would leave the rest of the run
  answering 401.
* ``ST_SERVED_MODEL``: a served model name put into every other generated body that names a ``model`` (chosen by
  a checksum of the body, so a seed gives the same cases), so the OpenAI routes run their whole path, not only
  the 404 of a made-up model.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import schemathesis


@schemathesis.hook
def filter_case(context: Any, case: Any) -> bool:
    protected = os.environ.get("ST_PROTECTED_KEY_ID")
    params = case.path_parameters or {}
    return not (protected and str(params.get("id")) == protected)


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    model = os.environ.get("ST_SERVED_MODEL")
    if model and isinstance(body, dict) and isinstance(body.get("model"), str):
        digest = zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode())
        if digest % 2 == 0:
            return {**body, "model": model}
    return body
