"""End-to-end tests of the engine worker process over the real Redis engine link."""

from __future__ import annotations

import time

import pytest

from inference.protocol.engine import (api_alive_key, FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP,
                                       replicas_index_key)
from tests.engine.conftest import MODEL

EOS_IDS = [151645, 151643]


def tokens(outs) -> list[int]:
    """All new token ids of one request's outputs, in order."""
    return [t for o in outs for t in o.new_token_ids]


def final(outs):
    """The one output carrying the finish reason."""
    fin = [o for o in outs if o.finish_reason]
    assert len(fin) == 1, outs
    return fin[0]

PROMPT = [9707, 11, 1879, 0, 3555, 374, 279, 6722, 315, 9625, 30]
OTHER_PROMPTS = [[100 + i, 200 + i, 300 + i, 400 + i] * (i + 1) for i in range(5)]


def test_first_output_on_accept_then_tokens(engine):
    rid = engine.send(PROMPT, temperature=0, max_tokens=5)
    outs = engine.collect([rid])[rid]
    first = outs[0]
    assert first.new_token_ids == [] and first.finish_reason is None
    assert first.queued_ts is not None and first.engine_id == engine.engine_id
    with_tokens = [o for o in outs if o.new_token_ids]
    assert with_tokens[0].first_token_ts is not None and with_tokens[0].scheduled_ts is not None
    assert with_tokens[0].first_token_ts >= first.queued_ts
    assert all(o.first_token_ts is None for o in with_tokens[1:])
    assert final(outs).finish_reason == FINISH_LENGTH and len(tokens(outs)) == 5
    assert final(outs).num_cached_tokens == 0


def test_greedy_is_deterministic(engine):
    a = engine.send(PROMPT, temperature=0, max_tokens=12)
    ra = tokens(engine.collect([a])[a])
    others = [engine.send(p, temperature=1.0, max_tokens=20) for p in OTHER_PROMPTS]
    b = engine.send(PROMPT, temperature=0, max_tokens=12)
    got = engine.collect([b, *others])
    assert tokens(got[b]) == ra and len(ra) == 12


def test_same_seed_same_output_across_batch_companions(engine):
    alone = engine.send(PROMPT, temperature=1.0, seed=1234, max_tokens=16)
    r_alone = tokens(engine.collect([alone])[alone])
    companions = [engine.send(p, temperature=0.7, max_tokens=24) for p in OTHER_PROMPTS[:3]]
    engine.collect(companions, until_first_token=True)  # the companions are running when ours joins
    again = engine.send(PROMPT, temperature=1.0, seed=1234, max_tokens=16)
    other_seed = engine.send(PROMPT, temperature=1.0, seed=99, max_tokens=16)
    got = engine.collect([again, other_seed])  # (a companion may have finished in the collect above)
    assert tokens(got[again]) == r_alone
    assert tokens(got[other_seed]) != r_alone  # the seed matters: random weights give near-uniform draws


def test_stop_token_ids_eos_and_min_tokens(engine):
    ref = engine.send(OTHER_PROMPTS[1], temperature=1.0, seed=5, max_tokens=12)
    ref_toks = tokens(engine.collect([ref])[ref])
    stop_id = ref_toks[3]
    k = ref_toks.index(stop_id)  # first occurrence
    rid = engine.send(OTHER_PROMPTS[1], temperature=1.0, seed=5, max_tokens=12, stop_token_ids=[stop_id])
    out = engine.collect([rid])[rid]
    assert tokens(out) == ref_toks[: k + 1]
    assert final(out).finish_reason == FINISH_STOP and final(out).stop_reason == stop_id
    # the same id as EOS: finish "stop" without stop_reason; ignored with ignore_eos
    eos = engine.send(OTHER_PROMPTS[1], temperature=1.0, seed=5, max_tokens=12, eos_token_ids=[stop_id])
    ign = engine.send(OTHER_PROMPTS[1], temperature=1.0, seed=5, max_tokens=12, eos_token_ids=[stop_id],
                      ignore_eos=True)
    # min_tokens masks the stop id: generation must run past position k
    mn = engine.send(OTHER_PROMPTS[1], temperature=0, max_tokens=6, min_tokens=6,
                     stop_token_ids=[stop_id], eos_token_ids=EOS_IDS)
    got = engine.collect([eos, ign, mn])
    assert tokens(got[eos]) == ref_toks[: k + 1]
    assert final(got[eos]).finish_reason == FINISH_STOP and final(got[eos]).stop_reason is None
    assert tokens(got[ign]) == ref_toks and final(got[ign]).finish_reason == FINISH_LENGTH
    assert stop_id not in tokens(got[mn]) and len(tokens(got[mn])) == 6


def test_greedy_min_tokens_masks_repeated_stop(engine):
    # greedy on random weights repeats one token; as a stop id it ends at once unless min_tokens masks it
    g = engine.send(PROMPT, temperature=0, max_tokens=3)
    tok = tokens(engine.collect([g])[g])[0]
    s = engine.send(PROMPT, temperature=0, max_tokens=3, stop_token_ids=[tok])
    m = engine.send(PROMPT, temperature=0, max_tokens=3, stop_token_ids=[tok], min_tokens=2)
    got = engine.collect([s, m])
    assert tokens(got[s]) == [tok] and final(got[s]).stop_reason == tok
    assert tok not in tokens(got[m])[:2] and len(tokens(got[m])) == 3


def test_max_model_len_and_too_long_prompt(engine):
    long_prompt = [1000 + (i % 500) for i in range(500)]
    rid = engine.send(long_prompt, temperature=0, max_tokens=100)
    bad = engine.send([5] * 512, temperature=0, max_tokens=1)
    got = engine.collect([rid, bad])
    assert final(got[rid]).finish_reason == FINISH_LENGTH and len(tokens(got[rid])) == 12
    assert final(got[bad]).finish_reason == FINISH_ERROR and "max_model_len" in final(got[bad]).error


def test_bad_token_id_fails_only_that_request(engine):
    good = engine.send(PROMPT, temperature=0, max_tokens=8)
    bad = engine.send([1, 2, 10**7], temperature=0, max_tokens=8)
    got = engine.collect([good, bad])
    assert final(got[bad]).finish_reason == FINISH_ERROR and "out of range" in final(got[bad]).error
    assert tokens(got[bad]) == []
    assert final(got[good]).finish_reason == FINISH_LENGTH and len(tokens(got[good])) == 8
    assert engine.proc.poll() is None


def test_logprobs_top_k(engine):
    rid = engine.send(PROMPT, temperature=1.0, seed=3, max_tokens=4, logprobs=3)
    outs = [o for o in engine.collect([rid])[rid] if o.new_token_ids]
    for o in outs:
        (sampled, top), = o.new_logprobs
        assert len(top) == 3 and sampled <= top[0][1] + 1e-6
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        if o.new_token_ids[0] == top[0][0]:
            assert abs(sampled - top[0][1]) < 1e-5


def _wait_idle(engine, timeout_s: float = 30) -> None:
    """Wait (bounded by ``timeout_s``) until the engine reports no running and no waiting request."""
    st = None
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        st = engine.stats()
        if st and st.num_running == 0 and st.num_waiting == 0:
            break
        time.sleep(0.1)
    assert st is not None and st.num_running == 0 and st.num_waiting == 0


def test_abort_frees_the_slot(engine):
    max_tokens = 512 - len(PROMPT)  # max_model_len 512: the most it can be asked for
    rid = engine.send(PROMPT, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    engine.collect([rid], until_first_token=True)
    engine.abort(rid)
    outs = engine.collect([rid], timeout=60)[rid]
    assert final(outs).finish_reason == FINISH_ABORT  # a lost abort ends with length
    assert len(tokens(outs)) < max_tokens
    _wait_idle(engine)


def test_abort_before_the_request_is_read(engine):
    rid = "early-" + str(time.time_ns())
    engine.abort(rid)
    # The engine reads the control stream right after each read of requests: once a request sent after the
    # abort has been accepted (its first output), the abort has been read, before ``rid`` exists.
    marker = engine.send(PROMPT, temperature=0, max_tokens=1)
    engine.collect([marker], timeout=60)
    engine.send(PROMPT, request_id=rid, temperature=0, max_tokens=300)
    outs = engine.collect([rid], timeout=60)[rid]
    assert final(outs).finish_reason == FINISH_ABORT and tokens(outs) == []


def test_sixteen_concurrent_requests_finish(engine):
    ids = [engine.send([50 + i] * (5 + i), temperature=0.8, seed=i, max_tokens=64, ignore_eos=True)
           for i in range(16)]
    got = engine.collect(ids, timeout=300)  # bounds a failure only: 16 x 64 tokens on a loaded 2-core box
    for rid in ids:
        assert final(got[rid]).finish_reason == FINISH_LENGTH and len(tokens(got[rid])) == 64
    st = engine.stats()
    assert st.prefill_tokens_per_s > 0 and st.decode_tokens_per_s > 0 and st.max_num_seqs == 8


@pytest.mark.native_only("the vLLM backend's heartbeat and SIGTERM are checked on the replica the live platform runs "
                         "(tests/e2e/test_vllm_backend_e2e.py), which saves a vLLM start of its own")
def test_heartbeat_and_sigterm(fresh_engine):
    eng = fresh_engine
    st = eng.stats()
    assert st is not None and st.engine_id == eng.engine_id and st.device == "cpu"
    assert 0 < eng.r.pttl(eng.hb_key) <= 3000
    index = replicas_index_key(eng.prefix, MODEL)  # expires a minute after the model's last heartbeat (no leftovers)
    assert 60_000 < eng.r.pttl(index) <= 63_000
    rid = eng.send(PROMPT, temperature=1.0, max_tokens=4000, ignore_eos=True)
    eng.collect([rid], until_first_token=True)
    assert eng.stop() == 0
    outs = eng.collect([rid], timeout=5)[rid]
    assert final(outs).finish_reason == FINISH_ERROR and "shut down" in final(outs).error
    assert not eng.r.exists(eng.hb_key)
    assert 0 < eng.r.pttl(index) <= 63_000 and eng.r.zscore(index, eng.engine_id) < time.time() * 1000


def test_requests_of_a_vanished_api_process_are_aborted(engine):
    """An api process that dies (its liveness key expires) must not leave its requests running: the engine
    drops them at its next liveness check (every ``CLIENT_CHECK_INTERVAL_S``), long before ``max_tokens``.
    The engine is held (SIGSTOP of its process group) across one check interval so that the check comes due before
    it generates more, however fast the machine."""
    import os
    import signal

    from inference.engine.replica_link import CLIENT_CHECK_INTERVAL_S

    max_tokens = 512 - len(PROMPT)
    rid = engine.send(PROMPT, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    first = engine.collect([rid], until_first_token=True)[rid]
    # the whole process group: vLLM's engine core runs in a child process of the replica and would go on
    # generating while only the replica's own process is held (CI saw 254 of 501 tokens that way)
    os.killpg(engine.proc.pid, signal.SIGSTOP)
    try:
        engine.r.delete(api_alive_key(engine.prefix, engine.client_id))
        time.sleep(CLIENT_CHECK_INTERVAL_S + 0.2)  # a lower bound on the pause, whatever the machine: check due
    finally:
        os.killpg(engine.proc.pid, signal.SIGCONT)
    _wait_idle(engine)
    # the engine's own outputs: never finished by length, far fewer tokens than asked (outputs for a vanished
    # client are dropped, so no abort output is expected)
    outs = first + [o for m in engine.read(timeout_ms=500) for o in m.outputs if o.request_id == rid]
    assert not any(o.finish_reason == FINISH_LENGTH for o in outs), outs
    assert len(tokens(outs)) < max_tokens // 2


def test_request_left_pending_by_a_dead_replica_is_taken_over(engine):
    """A replica killed between its XREADGROUP and XACK leaves the request pending for its consumer; a live
    replica takes it over (found by a fresh-clone user test: such a request waited for ever)."""
    import uuid

    from inference.protocol.engine import ENGINE_GROUP, EngineCoreRequest, SamplingParams, requests_stream

    rid = f"orphan-{uuid.uuid4().hex[:6]}"
    req = EngineCoreRequest(request_id=rid, external_req_id=rid, prompt_token_ids=PROMPT,
                            sampling_params=SamplingParams(max_tokens=3, temperature=0, eos_token_ids=EOS_IDS),
                            client_id=engine.client_id, arrival_time=time.time())
    engine.r.set(api_alive_key(engine.prefix, engine.client_id), b"1", ex=120)
    stream = requests_stream(engine.prefix, "tiny-qwen3")
    pipe = engine.r.pipeline(transaction=True)  # atomically: the live replica cannot read it first
    pipe.xadd(stream, {"r": req.to_wire()})
    pipe.xreadgroup(ENGINE_GROUP, "dead-replica-1", {stream: ">"}, count=1)
    pipe.execute()
    assert engine.r.xpending(stream, ENGINE_GROUP)["pending"] == 1
    # pending > 2 s, then claimed at the next reclaim pass (every 1 s): taken over, not left pending for ever
    outs = engine.collect([rid], timeout=60)[rid]
    assert final(outs).finish_reason == FINISH_LENGTH and len(tokens(outs)) == 3
    assert engine.r.xpending(stream, ENGINE_GROUP)["pending"] == 0


def _first_cached(outs) -> int:
    return next(o.num_cached_tokens for o in outs if o.new_token_ids)


@pytest.mark.native_only("our prefix cache's 16-token blocks (64 and 79 cached); vLLM's CPU blocks are 128 tokens: "
                        "test_prefix_cache_reports_whole_blocks_on_every_backend")
def test_prefix_cache_reuses_prompt_kv_with_the_same_output(engine):
    """A repeated 80-token prompt reuses 79 positions (the last one is recomputed for its logits), a prompt
    sharing its first 64 tokens reuses those 64 (four full 16-token blocks), and the outputs and logprobs equal
    the cold run's, also when the cached rows join a running batch."""
    shared = [47000 + 3 * i for i in range(70)]  # no other test sends these ids
    b_prompt, a_prompt = shared + list(range(2000, 2010)), shared + list(range(3000, 3012))
    kw = dict(temperature=0, max_tokens=8, logprobs=2)
    cold = engine.send(b_prompt, **kw)
    cold_outs = engine.collect([cold])[cold]
    assert _first_cached(cold_outs) == 0
    companions = [engine.send(p, temperature=0.7, max_tokens=24) for p in OTHER_PROMPTS[:3]]
    engine.collect(companions, until_first_token=True)  # the cached rows join a running batch
    partial = engine.send(a_prompt, **kw)
    warm = engine.send(b_prompt, **kw)
    got = engine.collect([partial, warm])
    assert _first_cached(got[partial]) == 64
    assert _first_cached(got[warm]) == len(b_prompt) - 1 == 79
    assert final(got[warm]).finish_reason == FINISH_LENGTH and len(tokens(got[partial])) == 8
    assert tokens(got[warm]) == tokens(cold_outs)
    for c, w in zip([o for o in cold_outs if o.new_token_ids], [o for o in got[warm] if o.new_token_ids]):
        assert abs(c.new_logprobs[0][0] - w.new_logprobs[0][0]) < 1e-4
        assert [t for t, _ in c.new_logprobs[0][1]] == [t for t, _ in w.new_logprobs[0][1]]


def test_prefix_cache_reports_whole_blocks_on_every_backend(engine):
    """A repeated 300-token prompt is served from the prefix cache on both backends: ``num_cached_tokens`` (vLLM's
    own on the vLLM backend) reports at least two 128-token blocks, the output and logprobs equal the cold run's."""
    prompt = [52000 + 7 * i for i in range(300)]  # no other test sends these ids
    kw = dict(temperature=0, max_tokens=6, logprobs=1)
    cold = engine.send(prompt, **kw)
    cold_outs = engine.collect([cold])[cold]
    assert _first_cached(cold_outs) == 0
    warm = engine.send(prompt, **kw)
    warm_outs = engine.collect([warm])[warm]
    assert 256 <= _first_cached(warm_outs) < 300
    assert tokens(warm_outs) == tokens(cold_outs)
    for c, w in zip([o for o in cold_outs if o.new_token_ids], [o for o in warm_outs if o.new_token_ids]):
        assert abs(c.new_logprobs[0][0] - w.new_logprobs[0][0]) < 1e-3
