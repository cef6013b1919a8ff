"""Hostile input (issue 17): schemathesis against the live platform's two OpenAPI descriptions.

* The REST API (``/api/v1/schema``, drf-spectacular), every check schemathesis has: no 5xx, every status and
  response as documented, schema-valid requests accepted, schema-invalid ones refused, a revoked key gone.
* The OpenAI routes (``/v1/openapi.json``, gateway/endpoints/openapi.py): no 5xx and every answer as documented (status,
  content type, headers, body). Requests that the pydantic models accept but a rule of the model refuses (token ids
  in the vocabulary, template rules, context length) are answered 400 by design, so the acceptance checks are
  not run there (DECISIONS D-179).

Each run is the schemathesis CLI with a fixed seed and a time budget (about 45 s for both); its output is shown on
failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from harness.assets import DEMO_MODEL
from harness import REPO

SEED = "17"
REST_BUDGET_S = 20
OPENAI_BUDGET_S = 25


def _schemathesis(live, location: str, key: str, budget_s: int, *args: str, env_extra: dict[str, str],
                  tmp_path: Path, config: Path | None = None) -> tuple[int, str]:
    """Run ``schemathesis run LOCATION`` against ``live`` with ``key`` (and the ``config`` file); ``(exit code,
    output)``. Exit 0: no failure and no error (its warnings, e.g. "operations mostly rejected generated data",
    do not fail a run)."""
    exe = Path(sys.executable).parent / "schemathesis"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")]),
           "SCHEMATHESIS_HOOKS": "tests.support.schemathesis_hooks", **env_extra}
    cmd = [str(exe), "--no-color", *(["--config-file", str(config)] if config else []), "run",
           live.base_url + location, "-H", f"Authorization: Bearer {key}", "--seed", SEED,
           "--max-time", str(budget_s), "--workers", "1", "--request-timeout", "30",
           "--report", "junit", "--report-dir", str(tmp_path), *args]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=budget_s + 120)
    return proc.returncode, proc.stdout + proc.stderr


def _count(live, code: str) -> int:
    """The integer ``manage.py shell -c CODE`` prints last."""
    return int(live.manage("shell", "-c", code).strip().splitlines()[-1])


def _key_id(live, secret: str) -> str:
    return live.manage("shell", "-c", (
        "from tenancy.selectors import api_key_authenticate; "
        f"print(api_key_authenticate('{secret}').key_id)")).strip().splitlines()[-1]


def test_rest_api_holds_to_its_schema(live, tmp_path):
    key = live.new_key(tenant="schemathesis-rest", scopes="inference,usage:read,keys:write")
    for name in ("first", "second"):  # keys to read, change, rotate and revoke besides the ones it creates
        r = httpx.post(live.base_url + "/api/v1/keys", json={"name": name},
                       headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 201, r.text
    rc, out = _schemathesis(live, "/api/v1/schema", key, REST_BUDGET_S, "--checks", "all",
                            env_extra={"ST_PROTECTED_KEY_ID": _key_id(live, key)}, tmp_path=tmp_path,
                            config=Path(__file__).with_name("schemathesis-rest.toml"))
    assert rc == 0, out[-12000:]
    # the run authenticated and got past validation (not a run of 401s and 400s): it created keys
    created = _count(live, "from tenancy.models import ApiKey; "
                           "print(ApiKey.objects.filter(tenant__name='schemathesis-rest').count())")
    assert created > 3, out[-4000:]


def test_openai_routes_hold_to_their_description(live, tmp_path):
    r = httpx.get(live.base_url + "/v1/openapi.json", timeout=30)  # public: no key (D-176)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert "/v1/chat/completions" in r.json()["paths"]
    key = live.new_key(tenant="schemathesis-openai")
    rc, out = _schemathesis(live, "/v1/openapi.json", key, OPENAI_BUDGET_S, "--checks",
                            "not_a_server_error,status_code_conformance,content_type_conformance,"
                            "response_headers_conformance,response_schema_conformance,ignored_auth",
                            env_extra={"ST_SERVED_MODEL": DEMO_MODEL}, tmp_path=tmp_path)
    assert rc == 0, out[-12000:]
    # the run reached the engine: some of its requests were answered 200 and recorded (usage flushes each second)
    code = ("from usage.models import UsageRecord; print(UsageRecord.objects.filter("
            "tenant__name='schemathesis-openai', status_code=200).count())")
    deadline = time.monotonic() + 15
    while _count(live, code) == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _count(live, code) > 0, out[-4000:]

