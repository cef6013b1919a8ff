"""``RequestState`` / ``OutputProcessor`` (inference/api/output_processor.py): per-choice output state and n > 1
reassembly, Django-free, over a real tokenizer and hand-made engine outputs."""

from __future__ import annotations

import pytest

from inference.api.output_processor import OutputProcessor, RequestState
from inference.protocol.engine import EngineCoreOutput
from inference.renderer.tokenizer_cache import get_tokenizer
from tests.renderer.tokdirs import tok_dir


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer(tok_dir("qwen3"))


def _state(tok, n=1, stop=None, include=False):
    prompt = tok.encode("Hello", add_special_tokens=False)
    return RequestState(tok, prompt, [f"r-{i}" for i in range(n)], stop=stop, include_stop_str_in_output=include,
                        skip_special_tokens=True, arrival_time=0.0)


def test_n_children_reassemble_into_their_choices(tok):
    """Interleaved outputs of two children land in their own choice, in order; counts sum over choices."""
    a, b = tok.encode(" one two three", add_special_tokens=False), tok.encode(" four five", add_special_tokens=False)
    state = _state(tok, n=2)
    proc = OutputProcessor(state)
    outs = []
    for i in range(max(len(a), len(b))):
        if i < len(b):
            outs.append(EngineCoreOutput("r-1", [b[i]], finish_reason="length" if i == len(b) - 1 else None))
        if i < len(a):
            outs.append(EngineCoreOutput("r-0", [a[i]], finish_reason="stop" if i == len(a) - 1 else None))
    result = proc.process_outputs(outs)
    assert state.finished and state.finished_time is not None
    assert [c.text for c in state.choices] == [" one two three", " four five"]
    assert [c.finish_reason for c in state.choices] == ["stop", "length"]
    assert state.completion_tokens == len(a) + len(b) and state.prompt_tokens == len(state.prompt_token_ids)
    assert "".join(d.text for d in result.deltas if d.index == 0) == " one two three"
    # the first tokens of each child are reported once; the request's first carries the time to first token
    assert [i for i, _ in result.first_tokens] == [1, 0]
    assert result.first_tokens[0][1] is not None and result.first_tokens[1][1] is None


def test_first_token_latency_splits_ttft_into_its_phases(tok):
    """The request's first tokens carry where its TTFT went: frontend on the api's clock (arrival → hand-off), queue
    and prefill on the replica's (queued → scheduled → first token), from the child whose tokens came first; a
    replica's timestamps are taken from the latest acceptance (a request sent again is read again)."""
    state = _state(tok, n=2)
    state.sent_time = 0.012
    proc = OutputProcessor(state)
    first = proc.process_outputs([EngineCoreOutput("r-0", queued_ts=1000.0), EngineCoreOutput("r-1", queued_ts=1000.0),
                                  EngineCoreOutput("r-1", queued_ts=2000.0)])  # r-1 sent again, read at 2000
    assert first.first_tokens == []
    ids = tok.encode(" hi", add_special_tokens=False)
    result = proc.process_outputs([EngineCoreOutput("r-1", ids, scheduled_ts=2000.25, first_token_ts=2000.3),
                                   EngineCoreOutput("r-0", ids, scheduled_ts=1000.5, first_token_ts=1000.6)])
    assert [i for i, _ in result.first_tokens] == [1, 0] and result.first_tokens[1][1] is None
    lat = result.first_tokens[0][1]
    assert lat is not None and lat.ttft_s == state.first_token_time - state.arrival_time and lat.ttft_s > 0
    assert lat.frontend_s == pytest.approx(0.012)
    assert lat.queue_s == pytest.approx(0.25) and lat.prefill_s == pytest.approx(0.05)  # r-1's, the second replica
    assert lat.phases() == pytest.approx({"frontend": 0.012, "queue": 0.25, "prefill": 0.05})
    # later tokens carry none; a replica that sends no timestamps leaves those phases out
    assert proc.process_outputs([EngineCoreOutput("r-0", ids)]).first_tokens == []
    bare = _state(tok)
    out = OutputProcessor(bare).process_outputs([EngineCoreOutput("r-0", ids)])
    only = out.first_tokens[0][1]
    assert only is not None and only.phases() == {}


def test_stop_string_finishes_the_choice_and_asks_for_an_abort(tok):
    """A stop string matched before the engine stops: the choice ends ``stop`` with the text cut before it, and
    the child is listed for an engine abort; later outputs of that child are ignored."""
    state = _state(tok, stop=[" STOP"])
    proc = OutputProcessor(state)
    ids = tok.encode(" go on STOP and more", add_special_tokens=False)
    result = proc.process_outputs([EngineCoreOutput("r-0", [t]) for t in ids])
    choice = state.choices[0]
    assert choice.text == " go on" and choice.finish_reason == "stop" and choice.stop_reason == " STOP"
    assert result.reqs_to_abort == ["r-0"]
    assert proc.process_outputs([EngineCoreOutput("r-0", [ids[0]])]).deltas == []


def test_errors_aborts_and_unknown_children(tok):
    """An engine error is kept per choice; unknown ids are ignored; ``abort_unfinished`` marks what is left."""
    state = _state(tok, n=2)
    proc = OutputProcessor(state)
    proc.process_outputs([EngineCoreOutput("nope", [1]),
                          EngineCoreOutput("r-0", [], finish_reason="error", error="boom")])
    assert state.error_message() == "boom" and not state.finished
    assert state.abort_unfinished() == ["r-1"] and state.choices[1].finish_reason == "abort"
    assert state.abort_unfinished() == []
