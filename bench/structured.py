"""Benchmark: structured outputs (issue 16) on the engine process over the real Redis link.

Starts ``python -m inference.engine`` on the demo model and measures, in the same run, against an unconstrained
baseline:

* decode throughput: ``--n`` concurrent requests of ``--new-tokens`` tokens each (temperature 1), unconstrained vs
  constrained by a JSON schema whose output is longer than ``--new-tokens`` (an array of ``minItems`` objects), so
  both sides generate the same number of tokens; decode tok/s counts the tokens after each request's first one,
  from the moment every request has its first token to the last one (goal: constrained ≥ 0.9× unconstrained);
* grammar compile time in this process (``GrammarCompiler`` on the model's tokenizer): cold (a schema never seen)
  and cached (the same schema again: cache hit plus the sequence's own matcher copy) (goal: cached ≤ 1 ms);
* time to first token of one request on an idle engine, unconstrained vs constrained (grammar cached, as for a
  client repeating its schema; and cold, a new schema each time) (goal: constrained ≤ 1.1×).

Rounds alternate baseline and constrained; figures are medians (compile, TTFT) or means (throughput).

    python bench/structured.py [--model-dir .cache/models/tiny-qwen3] [--n 16] [--new-tokens 64] [--rounds 3]
        [--redis-url redis://127.0.0.1:6379/3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inference.engine.structured import GrammarCompiler, SequenceGrammar
from inference.protocol.engine import (
    EngineCoreOutputs,
    EngineCoreRequest,
    SamplingParams,
    api_alive_key,
    outputs_stream,
    replica_key,
    requests_stream,
)

EOS = [151645, 151643]
PROMPT = [9707, 11, 1879, 0, 3555, 374, 279, 6722, 315, 9625, 30]
TYPICAL = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city"]},
    "status": {"enum": ["active", "inactive", "pending"]}, "score": {"type": "number"}},
    "required": ["name", "age", "tags", "address", "status"], "additionalProperties": False}
LONG = {"type": "object", "properties": {"items": {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}}, "required": ["items"]}


class Engine:
    """An engine subprocess and a client of its link."""

    def __init__(self, args):
        self.r = redis.Redis.from_url(args.redis_url)
        self.prefix, self.cid = f"b{uuid.uuid4().hex[:6]}", f"c{uuid.uuid4().hex[:6]}"
        self.proc = subprocess.Popen([sys.executable, "-m", "inference.engine", "--model", "m", "--model-dir",
                                      args.model_dir, "--redis-url", args.redis_url, "--link-prefix", self.prefix,
                                      "--engine-id", "bench", "--log-level", "WARNING",
                                      "--max-num-seqs", str(max(args.n, 8))],
                                     cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        deadline = time.time() + 180
        while not self.r.exists(replica_key(self.prefix, "m", "bench")):
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("engine did not start")
            time.sleep(0.1)
        self.last = "$"
        self.r.set(api_alive_key(self.prefix, self.cid), b"1", ex=3600)

    def run(self, n: int, max_tokens: int, **sp) -> dict[str, dict]:
        """Send ``n`` requests at once; per request: send time, first-token time, end time, token count."""
        pipe = self.r.pipeline(transaction=False)
        reqs = {}
        t0 = time.perf_counter()
        for i in range(n):
            rid = f"r{i}-{uuid.uuid4().hex[:6]}"
            params = SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, eos_token_ids=EOS, **sp)
            req = EngineCoreRequest(request_id=rid, external_req_id=rid, prompt_token_ids=PROMPT,
                                    sampling_params=params, client_id=self.cid, arrival_time=time.time())
            pipe.xadd(requests_stream(self.prefix, "m"), {"r": req.to_wire()})
            reqs[rid] = {"sent": t0, "first": None, "end": None, "tokens": 0, "finish": None}
        pipe.execute()
        open_ = set(reqs)
        while open_:
            resp = self.r.xread({outputs_stream(self.prefix, self.cid): self.last}, block=1000)
            now = time.perf_counter()
            for _s, entries in resp or []:
                for eid, fields in entries:
                    self.last = eid
                    for o in EngineCoreOutputs.from_wire(fields[b"o"]).outputs:
                        st = reqs.get(o.request_id)
                        if st is None:
                            continue
                        if o.new_token_ids and st["first"] is None:
                            st["first"] = now
                        st["tokens"] += len(o.new_token_ids)
                        if o.finish_reason:
                            st["end"], st["finish"] = now, o.finish_reason
                            if o.error:
                                raise RuntimeError(o.error)
                            open_.discard(o.request_id)
        return reqs

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        keys = list(self.r.scan_iter(f"{self.prefix}:*"))
        if keys:
            self.r.delete(*keys)


def decode_tps(reqs: dict[str, dict]) -> float:
    start = max(s["first"] for s in reqs.values())
    end = max(s["end"] for s in reqs.values())
    # tokens generated after ``start`` are approximated by tokens after each one's first: all firsts are close
    return sum(s["tokens"] - 1 for s in reqs.values()) / max(end - start, 1e-9)


def compile_times(model_dir: str, count: int) -> tuple[float, float]:
    """Median cold and cached compile times (ms) of the typical schema (a unique title makes each one new)."""
    comp = GrammarCompiler(model_dir, EOS, threads=1)
    _ = comp.tokenizer  # built once per engine (before it serves); not part of a request's compile
    cold, cached = [], []
    for i in range(count):
        spec = json.dumps({**TYPICAL, "title": f"t{i}-{uuid.uuid4().hex}"})
        t = time.perf_counter()
        g = SequenceGrammar(comp.compile("json", spec), [], frozenset(EOS))
        g.future.result()
        g.start()
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        g = SequenceGrammar(comp.compile("json", spec), [], frozenset(EOS))
        g.start()
        cached.append(time.perf_counter() - t)
    comp.shutdown()
    return statistics.median(cold) * 1e3, statistics.median(cached) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=str(ROOT / ".cache/models/tiny-qwen3"))
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/3"))
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ttft-samples", type=int, default=10)
    args = ap.parse_args()

    cold_ms, cached_ms = compile_times(args.model_dir, 20)
    print(f"grammar compile (typical JSON schema): cold {cold_ms:.2f} ms, cached {cached_ms:.3f} ms "
          f"(goal cached <= 1 ms)")

    eng = Engine(args)
    long_spec = json.dumps(LONG)
    typical_spec = json.dumps(TYPICAL)
    try:
        eng.run(args.n, 8)
        eng.run(args.n, 8, structured_kind="json", structured_spec=long_spec)  # warm-up, grammar cached
        base, cons = [], []
        for _ in range(args.rounds):
            a = eng.run(args.n, args.new_tokens)
            b = eng.run(args.n, args.new_tokens, structured_kind="json", structured_spec=long_spec)
            assert all(s["tokens"] == args.new_tokens for s in [*a.values(), *b.values()])
            base.append(decode_tps(a))
            cons.append(decode_tps(b))
        tb, tc = statistics.mean(base), statistics.mean(cons)
        print(f"decode throughput, batch {args.n} x {args.new_tokens} tokens: unconstrained {tb:.1f} tok/s, "
              f"JSON-schema constrained {tc:.1f} tok/s, ratio {tc / tb:.3f}x (goal >= 0.9x)")

        def ttft(**sp) -> float:
            st = next(iter(eng.run(1, 1, **sp).values()))
            return st["first"] - st["sent"]
        eng.run(1, 1, structured_kind="json", structured_spec=typical_spec)
        t_base, t_cached, t_cold = [], [], []
        for i in range(args.ttft_samples):
            t_base.append(ttft())
            t_cached.append(ttft(structured_kind="json", structured_spec=typical_spec))
            t_cold.append(ttft(structured_kind="json",
                               structured_spec=json.dumps({**TYPICAL, "title": f"c{i}-{uuid.uuid4().hex}"})))
        mb, mc, mk = (statistics.median(x) * 1e3 for x in (t_base, t_cached, t_cold))
        print(f"TTFT (idle engine, 1 request): unconstrained {mb:.1f} ms, constrained (grammar cached) {mc:.1f} ms "
              f"= {mc / mb:.3f}x (goal <= 1.1x), constrained (cold compile) {mk:.1f} ms = {mk / mb:.3f}x")
    finally:
        eng.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
