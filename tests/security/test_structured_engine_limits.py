"""Issue 39 (fresh-eyes findings): a constraint that passes every cap and the gateway's tokenizer-free compile can
still be costly or fail where only the engine sees it (its first mask: the lexer's precomputation over the real token
trie; later steps: the library's limits). Found:

* ``(a{1000}){1000}X`` cost the engine's step 0.7 s and ~180 MB per unique grammar (kept in the compiled-grammar
  cache: 21 GB and an OOM kill after ~100 requests), then failed as a retryable 503 ``engine_error``, and the same
  grammar sent again "succeeded" as an empty ``stop`` (the ``openai`` client's retries turned the first into that);
* ``(.{1,50}){1,50}`` was silently not enforced: the library gave up at the first mask and left only EOS allowed.

Now the first mask's work is bounded (``initial_lexer_fuel``), a matcher in error fails its row with
``ERROR_STRUCTURED_OUTPUT`` (never an EOS the grammar did not allow), a failed grammar leaves the cache, and the
gateway answers such a failure 400 ``structured_output_failed`` naming the field (in-band once a stream started).
The real scheduler in this process (no Redis); then the live platform."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from inference.engine.core import replica_stats
from inference.engine.runner import ModelRunner
from inference.engine.scheduler import Scheduler
from inference.protocol.engine import (
    ERROR_STRUCTURED_OUTPUT,
    FINISH_ERROR,
    EngineCoreRequest,
    SamplingParams,
)
from inference.shared.structured import normalize
from harness.assets import DEMO_MODEL, MODEL_DIR, ensure_demo_assets

EOS_IDS = [151645, 151643]
PROMPT = [9707, 11, 1879, 0, 3555, 374, 279, 6722, 315, 9625, 30]


@pytest.fixture(scope="module")
def scheduler():
    ensure_demo_assets()
    core = Scheduler(ModelRunner(str(MODEL_DIR), max_model_len=256), "e", replica_stats("e", "m", "cpu", 8),
                     max_num_seqs=8)
    _ = core.grammars.tokenizer  # built once (~1 s), before any request is timed
    yield core
    core.shutdown()


def run(core: Scheduler, kind: str, spec: str, rid: str, salt: str = "s") -> tuple[list[int], object, float]:
    """One constrained request through the scheduler: its tokens, its final output and the CPU seconds taken."""
    sp = SamplingParams(temperature=1.0, seed=1, max_tokens=30, eos_token_ids=EOS_IDS, structured_kind=kind,
                        structured_spec=normalize(kind, spec))  # the engine form, unprobed: the engine's own guard
    t0 = time.process_time()
    outs = [o for o in core.accept([EngineCoreRequest(request_id=rid, external_req_id=rid, prompt_token_ids=PROMPT,
                                                      sampling_params=sp, client_id="c", arrival_time=time.time(),
                                                      cache_salt=salt)])["c"] if o.finish_reason]
    for _ in range(200):
        if not core.running and not core.waiting:
            break
        outs += [o for part in core.step() for o in part.get("c", []) if o.new_token_ids or o.finish_reason]
        if core.waiting and not core.running:
            core.wait_if_blocked()
    final = [o for o in outs if o.finish_reason][-1]
    return [t for o in outs for t in o.new_token_ids], final, time.process_time() - t0


@pytest.mark.parametrize("spec", ["(a{1000}){1000}X", "((a{100}){100}){100}Y", "(.{1,50}){1,50}"])
def test_a_grammar_the_library_gives_up_on_fails_its_request_cheaply(scheduler, spec):
    tokens, final, cpu = run(scheduler, "regex", spec, f"r-{spec}")
    assert final.finish_reason == FINISH_ERROR and final.error_code == ERROR_STRUCTURED_OUTPUT, final
    assert not any(t in EOS_IDS for t in tokens)  # never an EOS the grammar did not allow (an empty "stop")
    assert cpu < 0.5, cpu  # was 0.7 s of the step (1M of initial lexer fuel), now ~40 ms (100k)
    # the failed grammar left the cache: the same grammar again fails the same way, not as an empty "stop"
    again_tokens, again, _ = run(scheduler, "regex", spec, f"r2-{spec}")
    assert again.finish_reason == FINISH_ERROR and again.error_code == ERROR_STRUCTURED_OUTPUT, again


def test_ordinary_constraints_still_run_under_the_lower_fuel(scheduler):
    tokens, final, _ = run(scheduler, "regex", r"[a-zA-Z0-9._%+-]{1,8}@[a-z]{2,6}\.[a-z]{2,3}", "email")
    assert final.error is None and final.error_code is None, final


# ------------------------------------------------------------------------------------------------ live
@pytest.fixture(scope="module")
def live(shared_live):
    return shared_live


def completion(live, **body):
    return httpx.post(live.base_url + "/v1/completions", timeout=120, headers={"Authorization": f"Bearer {live.api_key}"},
                      json={"model": DEMO_MODEL, "prompt": "hi", "max_tokens": 20, **body})


def test_live_a_failed_constraint_is_a_400_naming_its_field_every_time_and_the_engine_keeps_no_memory(live):
    engine = psutil.Process(live.replicas(DEMO_MODEL)[0].pid)
    before = engine.memory_info().rss
    for i in range(8):  # passes the gateway's byte-vocabulary probe; fails the engine's first mask on the real one
        resp = completion(live, structured_outputs={"regex": f"(.{{1,50}}){{1,50}}X{i}"})
        assert resp.status_code == 400, resp.text[:300]  # was a 503 engine_error, retried into an empty 200
        err = resp.json()["error"]
        assert (err["code"], err["param"], err["type"]) == ("structured_output_failed", "structured_outputs.regex",
                                                            "invalid_request_error"), err
    again = completion(live, structured_outputs={"regex": "(.{1,50}){1,50}X0"})
    assert again.status_code == 400, again.text[:300]
    assert engine.memory_info().rss - before < 200 * 2 ** 20  # (a{1000}){1000}X kept ~180 MB per unique grammar
    with httpx.stream("POST", live.base_url + "/v1/completions", timeout=120,
                      headers={"Authorization": f"Bearer {live.api_key}"},
                      json={"model": DEMO_MODEL, "prompt": "hi", "max_tokens": 20, "stream": True,
                            "structured_outputs": {"regex": "(.{1,50}){1,50}"}}) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert any('"structured_output_failed"' in e for e in events), events  # in-band, once the stream started
    ok = completion(live, structured_outputs={"regex": "[a-c]{3}"})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) == 3
