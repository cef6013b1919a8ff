"""Issue 39 on the shared live platform: client grammars, regexes and schemas, pathological or fuzzed, never freeze
the api (``/health`` answers within 50 ms all along), never cost another tenant its ``/v1/models``, never stall the
engine's heartbeat; each is a 200 or a 400 naming its field; the ``tool_choice`` schema is checked like any other.

The review's reproductions: a grammar of 9,000 blank lines on ``/v1/completions/render`` froze the api's loop for
1.7 s; a valid GBNF grammar followed by 16,000 blank lines froze the api 6.3 s, then the engine replica that compiled
it (its heartbeat lapsed, another tenant's stream failed); six concurrent 17 KB ``$ref`` chains took another tenant's
``/v1/models`` from 14 ms to 4.9 s; an invalid ``tool_choice`` schema came back as a retryable 503 ``engine_error``."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.protocol.engine import replica_key
from harness.assets import DEMO_MODEL

HEALTH_BOUND_S = 0.05


@pytest.fixture(scope="module")
def live(shared_live):
    return shared_live


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def other_key(live):
    return live.new_key(tenant="grammar-bystander")


@contextmanager
def health_watch(base_url: str, period_s: float = 0.02):
    """Poll ``/health`` on a connection of its own every ``period_s`` while the block runs; yields a dict whose
    ``worst`` is the slowest answer (seconds), ``n`` the number of polls and ``slow`` the answers over the bound."""
    seen: dict = {"worst": 0.0, "n": 0, "slow": []}
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=base_url, timeout=30) as client:
            client.get("/health")  # the connection is open before timing starts
            while not stop.is_set():
                t0 = time.perf_counter()
                assert client.get("/health").status_code == 200
                took = time.perf_counter() - t0
                seen["worst"] = max(seen["worst"], took)
                if took >= HEALTH_BOUND_S:
                    seen["slow"].append(round(took, 3))
                seen["n"] += 1
                stop.wait(period_s)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(30)


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


# ~0.5 s of the library's GBNF conversion (its fixpoint is quadratic in chained rules), within every cap
CHAIN = "\n".join(["root ::= r0", *(f'r{i} ::= "a" "a" "a" "a" "a" "a" "a" "a" "a" "a" r{i + 1}' for i in range(500)),
                   'r500 ::= "b"'])
# large constraints an engine compiles and masks with: 400 rules, 1,200 properties
WIDE_GRAMMAR = "\n".join(["root ::= " + " | ".join(f"r{i}" for i in range(400)),
                          *(f'r{i} ::= "w{i}" [a-z]{{1,8}} ("-" [0-9]+)?' for i in range(400))])
WIDE_SCHEMA = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 12} for i in range(1200)},
               "required": [f"field_{i}" for i in range(0, 1200, 3)]}


@pytest.fixture(scope="module", autouse=True)
def warm(live, http):
    """A plain render first: the api process's first request to the model loads its tokenizer (in a thread, but
    holding the GIL for part of ~0.4 s), which is not what these tests measure."""
    assert render(http, live.api_key, "/v1/completions/render").status_code == 200


def render(http, key, path, **body):
    body = {"model": DEMO_MODEL, "max_tokens": 4, **body}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return http.post(path, json=body, headers={"Authorization": f"Bearer {key}"})


def attack(live, http, other_key, nonce: str) -> tuple[dict, list[float]]:
    """The review's reproductions at once (every schema unique by ``nonce``: compiles are cached), while ``/health``
    and another tenant's ``/v1/models`` are polled; checks each answer; returns the ``/health`` watch and the
    ``/v1/models`` times."""
    attacks = [
        ("/v1/completions/render", {"structured_outputs": {"grammar": "\n" * 9000 + nonce}},
         "structured_outputs.grammar"),
        ("/v1/completions", {"structured_outputs": {"grammar": f'root ::= "{nonce}"' + "\n" * 16_000}},
         "structured_outputs.grammar"),
        *[("/v1/chat/completions/render", {"response_format": {"type": "json_schema", "json_schema": {
            "name": f"chain{i}", "schema": {**ref_chain(480), "title": nonce}}}}, None) for i in range(6)],
        ("/v1/completions/render", {"structured_outputs": {"grammar": f"{CHAIN}\n# {nonce}"}}, None),
        ("/v1/completions/render", {"structured_outputs": {"json": {**ref_chain(600), "title": nonce}}},
         "structured_outputs.json"),
    ]
    models_times: list[float] = []
    with health_watch(live.base_url) as health, ThreadPoolExecutor(len(attacks)) as pool:
        futures = [pool.submit(render, http, live.api_key, path, **body) for path, body, _param in attacks]
        with httpx.Client(base_url=live.base_url, timeout=30,
                          headers={"Authorization": f"Bearer {other_key}"}) as bystander:
            bystander.get("/v1/models")
            while not all(f.done() for f in futures):
                t0 = time.perf_counter()
                assert bystander.get("/v1/models").status_code == 200
                models_times.append(time.perf_counter() - t0)
                time.sleep(0.02)
        responses = [f.result() for f in futures]
    for (path, _body, param), resp in zip(attacks, responses):
        if param is None:
            assert resp.status_code == 200, (path, resp.text[:300])
        else:
            assert resp.status_code == 400, (path, resp.text[:300])
            assert resp.json()["error"]["param"] == param
    assert health["n"] >= 3, health
    return health, models_times


def test_pathological_constraints_never_freeze_the_api_nor_slow_another_tenant(live, http, other_key):
    """``/health`` within 50 ms and another tenant's ``/v1/models`` within 0.5 s all along (they froze for 1.7 s and
    took 4.9 s). A machine shared with the rest of the suite (a platform stopping on a thread beside this one) can
    delay one poll by itself, so a round over either bound is run once more with new schemas: a real freeze fails
    both rounds."""
    rounds = []
    for nonce in ("r1", "r2"):
        health, models_times = attack(live, http, other_key, nonce)
        rounds.append((health["worst"], max(models_times)))
        if health["worst"] < HEALTH_BOUND_S and max(models_times) < 0.5:
            return
    raise AssertionError(f"/health worst and /v1/models worst (s) in each round: {rounds}")


def test_the_engine_heartbeat_never_lapses_and_other_streams_finish(live, other_key):
    """Large constraints compiled and masked by the engine (in llguidance's native code, off the GIL) beside another
    tenant's stream: the replica's heartbeat key never comes near its TTL, the stream finishes."""
    replica = live.replicas(DEMO_MODEL)[0]
    key = replica_key(live.prefix, DEMO_MODEL, replica.engine_id)
    r = live.redis
    lowest = {"pttl": 10_000}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            lowest["pttl"] = min(lowest["pttl"], int(r.pttl(key)))
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            constrained = [pool.submit(httpx.post, live.base_url + "/v1/completions", timeout=120,
                                       headers={"Authorization": f"Bearer {live.api_key}"},
                                       json={"model": DEMO_MODEL, "prompt": "hi", "max_tokens": 8,
                                             "structured_outputs": so})
                           for so in ({"grammar": WIDE_GRAMMAR}, {"json": WIDE_SCHEMA},
                                      {"grammar": 'root ::= "b"' + "\n" * 16_000})]  # the review's: never sent on
            stream = pool.submit(_stream_text, live.base_url, other_key)
            assert [f.result().status_code for f in constrained] == [200, 200, 400], [f.result().text[-400:]
                                                                                      for f in constrained]
            assert stream.result() == "length"
    finally:
        stop.set()
        watcher.join(10)
    assert lowest["pttl"] > 1000, lowest  # a heartbeat every 0.5 s keeps it near 3000 ms; -2 = lapsed


def _stream_text(base_url: str, key: str) -> str:
    finish = ""
    with httpx.stream("POST", base_url + "/v1/completions", timeout=120, headers={"Authorization": f"Bearer {key}"},
                      json={"model": DEMO_MODEL, "prompt": "hello", "max_tokens": 48, "stream": True,
                            "ignore_eos": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                finish = chunk["choices"][0].get("finish_reason") or finish
    return finish


@pytest.mark.parametrize(("tools", "tool_choice", "param"), [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
     {"type": "function", "function": {"name": "f"}}, "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "g"}},
      {"type": "function", "function": {"name": "f", "parameters": ref_chain(600)}}],
     {"type": "function", "function": {"name": "f"}}, "tools[1].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]}}}],
     "required", "tools"),
])
def test_a_tool_choice_schema_is_checked_like_any_other(live, http, tools, tool_choice, param):
    resp = http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {live.api_key}"}, json={
        "model": DEMO_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": tools,
        "tool_choice": tool_choice})
    assert resp.status_code == 400, resp.text[:300]  # was a retryable 503 engine_error
    assert resp.json()["error"]["param"] == param


# ------------------------------------------------------------------------------------------------ fuzzing
_ATOM = st.sampled_from(['"a"', '"bc"', "[a-z]", "[0-9]+", "x", "y", "(", ")", "|", "*", "+", "?", "{2,3}", " ",
                         "\n", "\n\n\n", "::=", ":", "start", "root", "%llguidance {}", "/[a-c]+/", "#c\n"])
GRAMMARS = st.one_of(
    st.lists(_ATOM, max_size=60).map("".join),
    st.integers(1, 600).map(lambda n: "\n".join(["root ::= r0", *(f'r{i} ::= "a" r{i + 1}' for i in range(n)),
                                                  f'r{n} ::= "b"'])),
    st.integers(1, 90).map(lambda d: "start: " + "(" * d + '"a"' + ")" * d),
    st.integers(1, 20_000).map(lambda k: 'root ::= "a"' + "\n" * k),
)
REGEXES = st.one_of(
    st.lists(st.sampled_from(["a", "b", "(", ")", "|", "*", "+", "?", "{1,50}", "[a-z]", "\\d", ".", "(a+)+",
                              "(a|aa)*", "\\p{L}"]), min_size=1, max_size=60).map("".join),
    st.integers(1, 90).map(lambda d: "(" * d + "a+" + ")*" * d),
)
_LEAF = st.sampled_from([{"type": "string"}, {"type": "integer", "minimum": -5, "maximum": 10 ** 12},
                         {"type": "string", "pattern": "((a|b){1,40}){1,40}"}, {"$ref": "#"}, {"enum": ["a", 1]},
                         {"type": "array", "items": {"$ref": "#/$defs/x"}, "minItems": 3}])
SCHEMAS = st.one_of(
    st.recursive(_LEAF, lambda inner: st.one_of(
        st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3).map(
            lambda p: {"type": "object", "properties": p}),
        st.lists(inner, min_size=1, max_size=4).map(lambda xs: {"anyOf": xs}),
        inner.map(lambda x: {"type": "array", "items": x})), max_leaves=30).map(
        lambda s: {"$defs": {"x": {"type": "boolean"}}, **s} if isinstance(s, dict) else s),
    st.integers(1, 700).map(ref_chain),
    st.integers(1, 60).map(lambda d: json.loads('{"items":' * d + "{}" + "}" * d)),
)
CONSTRAINTS = st.one_of(GRAMMARS.map(lambda g: {"structured_outputs": {"grammar": g}}),
                        REGEXES.map(lambda r: {"structured_outputs": {"regex": r}}),
                        SCHEMAS.map(lambda s: {"structured_outputs": {"json": s}}))


@pytest.fixture(scope="module")
def fuzz_health(live):
    with health_watch(live.base_url) as health:
        yield health


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=CONSTRAINTS)
def test_fuzzed_constraints_are_200_or_400_within_their_budget(live, http, fuzz_health, body):
    t0 = time.perf_counter()
    resp = render(http, live.api_key, "/v1/completions/render", **body)
    took = time.perf_counter() - t0
    assert resp.status_code in (200, 400), resp.text[:300]
    if resp.status_code == 400:
        assert resp.json()["error"]["param"].startswith("structured_outputs."), resp.text[:300]
    assert took < 10, took  # one compile's CPU budget (1 s) and its queueing, with room for a loaded machine
    # every /health answer within the bound but for a stray one a shared machine can cause by itself; a freeze of
    # the loop (the 1.7 s of the review) is far over the second bound
    slow = fuzz_health["slow"]
    assert len(slow) <= max(1, fuzz_health["n"] // 50) and fuzz_health["worst"] < 0.5, fuzz_health
