"""Benchmark: the engine process over the real Redis link vs ``model.generate`` batched.

Starts ``python -m inference.engine`` on the demo model, sends N concurrent requests (default 16, 64
new tokens each, greedy, ``ignore_eos``) straight onto the engine link, and reads the streamed
outputs; then runs ``model.generate`` on the same prompts in one left-padded batch in this process.
Prints tokens/s of both and their ratio (engine / generate; > 1 means the engine is faster).

    python bench/engine_direct.py [--model-dir .cache/models/tiny-qwen3] [--n 16] [--new-tokens 64]
        [--redis-url redis://127.0.0.1:6379/3]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inference.protocol.engine import (
    API_ALIVE_TTL_S,
    EngineCoreOutputs,
    api_alive_key,
    EngineCoreRequest,
    SamplingParams,
    outputs_stream,
    replica_key,
    requests_stream,
)


def run_engine(args, prompts) -> float:
    """Tokens/s of the engine process for ``prompts`` sent at once (measured from send to last)."""
    r = redis.Redis.from_url(args.redis_url)
    prefix, eid, cid = f"b{uuid.uuid4().hex[:6]}", "bench", f"c{uuid.uuid4().hex[:6]}"
    proc = subprocess.Popen([sys.executable, "-m", "inference.engine", "--model", "m", "--model-dir",
                             args.model_dir, "--redis-url", args.redis_url, "--link-prefix", prefix,
                             "--engine-id", eid, "--log-level", "WARNING"],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        deadline = time.time() + 120
        while not r.exists(replica_key(prefix, "m", eid)):
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError("engine did not start")
            time.sleep(0.1)
        best = 0.0
        for _ in range(args.repeat):
            # the engine aborts requests of an api process whose liveness key is gone (this script stands in for one)
            r.set(api_alive_key(prefix, cid), b"1", ex=API_ALIVE_TTL_S * 6)
            t0 = time.perf_counter()
            pipe = r.pipeline(transaction=False)
            for i, p in enumerate(prompts):
                sp = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
                req = EngineCoreRequest(request_id=f"r{i}-{uuid.uuid4().hex[:4]}", external_req_id=f"r{i}",
                                        prompt_token_ids=p, sampling_params=sp, client_id=cid,
                                        arrival_time=time.time())
                pipe.xadd(requests_stream(prefix, "m"), {"r": req.to_wire()})
            pipe.execute()
            done, ntok, last = 0, 0, "0-0"
            while done < len(prompts):
                resp = r.xread({outputs_stream(prefix, cid): last}, block=5000)
                if not resp:
                    raise RuntimeError("engine stalled")
                for _s, entries in resp:
                    for entry_id, fields in entries:
                        last = entry_id
                        for o in EngineCoreOutputs.from_wire(fields[b"o"]).outputs:
                            ntok += len(o.new_token_ids)
                            done += o.finish_reason is not None
            dt = time.perf_counter() - t0
            r.delete(outputs_stream(prefix, cid))
            best = max(best, ntok / dt)
        return best
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        keys = list(r.scan_iter(f"{prefix}:*"))
        if keys:
            r.delete(*keys)


def run_generate(args, prompts) -> float:
    """Tokens/s of ``model.generate`` on ``prompts`` as one left-padded batch (best of repeats)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id or 0
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    best = 0.0
    with torch.inference_mode():
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                           min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad)
            best = max(best, len(prompts) * args.new_tokens / (time.perf_counter() - t0))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=str(ROOT / ".cache/models/tiny-qwen3"))
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/3"))
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(150000) for _ in range(20 + i)] for i in range(args.n)]
    eng = run_engine(args, prompts)
    gen = run_generate(args, prompts)
    print(f"engine   {eng:8.1f} tokens/s  ({args.n} concurrent, {args.new_tokens} new tokens each)")
    print(f"generate {gen:8.1f} tokens/s  (one batch)")
    print(f"ratio engine/generate {eng / gen:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
