"""The measurements of ``bench/gpu_check.sh`` (see there): our engine, and vLLM when ``.peer/vllm`` exists.

1. Builds a random-weights model of a real size locally (Qwen3-0.6B's config, no hub; ``--small``: the demo
   model's 2-layer config) with the Qwen3 tokenizer files from ``.cache/tokenizers/qwen3`` when present.
2. Our engine, in this process (``Scheduler.step`` on a ``ModelRunner``, no Redis needed): for 1, 16 and 64
   concurrent streams (``--concurrency``), all sent at once, ``--new-tokens`` tokens each (greedy, EOS ignored):
   output tokens/s (first send to last token) and TTFT p50 (send to first token).
3. vLLM's own OpenAI server from ``.peer/vllm`` (``bin/python -m vllm.entrypoints.openai.api_server``) on the same
   model directory, the same prompts as token ids over streaming ``/v1/completions``: the same two figures.
   (The platform's vLLM engine backend, ``inference/engine/vllm_backend``, is measured by bench/vllm_backend.py.)

Prints one line per (system, concurrency) and our/vLLM ratios. ``--dry-run`` builds the small model on the CPU and
runs every step at tiny sizes (seconds) to catch errors where there is no GPU.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, rope_theta=1_000_000, tie_word_embeddings=True, eos_token_id=151645,
                  bos_token_id=151643, pad_token_id=151643)
SMALL = dict(QWEN3_0_6B, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=151680, max_position_embeddings=4096)


def build_model(out: Path, small: bool, dtype: str) -> None:
    """A Qwen3 causal LM with random weights at ``out`` (config, safetensors, generation config, tokenizer)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**(SMALL if small else QWEN3_0_6B))
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(out)
    GenerationConfig(eos_token_id=[151645, 151643], pad_token_id=151643).save_pretrained(out)
    tok = ROOT / ".cache" / "tokenizers" / "qwen3"
    if tok.is_dir():
        for f in tok.iterdir():
            if f.is_file() and not (out / f.name).exists():
                shutil.copy(f, out / f.name)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 150000) for _ in range(length + i % 8)] for i in range(n)]


def ours(model_dir: Path, args, conc: int, seed: int) -> tuple[float, float]:
    """(output tokens/s, TTFT p50 s) of our engine for ``conc`` streams sent at once."""
    from inference.engine.core import replica_stats
    from inference.engine.scheduler import Scheduler
    from inference.protocol.engine import EngineCoreRequest, SamplingParams

    runner = RUNNERS[0]
    runner.reset()
    core = Scheduler(runner, "bench", replica_stats("bench", "m", runner.device.type, max(conc, 1)),
                     max_num_seqs=max(conc, 1), max_num_batched_tokens=max(args.max_num_batched_tokens, conc))
    t0 = time.perf_counter()
    for i, p in enumerate(prompts(conc, args.prompt_len, seed)):
        sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        core.accept([EngineCoreRequest(request_id=f"r{i}", external_req_id=f"r{i}", prompt_token_ids=p,
                                       sampling_params=sp, client_id="c", arrival_time=time.time())])
    first: dict[str, float] = {}
    ntok = 0
    while core.num_held:
        parts = list(core.step())
        t = time.perf_counter() - t0
        for part in parts:
            for outs in part.values():
                for o in outs:
                    ntok += len(o.new_token_ids)
                    if o.new_token_ids:
                        first.setdefault(o.request_id, t)
    return ntok / (time.perf_counter() - t0), statistics.median(first.values())


RUNNERS: list = []


def vllm_stream(port: int, prompt: list[int], new_tokens: int, t0: float, res: list) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": new_tokens, "min_tokens": new_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first, n = None, 0
    for line in resp:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
            first = first or time.perf_counter() - t0
            n += 1
    res.append((first or 0.0, n))
    conn.close()


def vllm(model_dir: Path, args, concs: list[int]) -> dict[int, tuple[float, float]]:
    py = ROOT / ".peer" / "vllm" / "bin" / "python"
    if not py.exists():
        print("vLLM: .peer/vllm not present, skipped")
        return {}
    port = 8011
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
           "m", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
           "--max-num-seqs", str(max(concs))]
    if args.device == "cpu":
        cmd += ["--dtype", "bfloat16", "--enforce-eager"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1"),
                            stdout=subprocess.DEVNULL, stderr=open(Path(args.work) / "vllm.log", "wb"))
    out: dict[int, tuple[float, float]] = {}
    try:
        deadline = time.time() + args.vllm_start_s
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline or proc.poll() is not None:
                print(f"vLLM: did not start (log {Path(args.work) / 'vllm.log'})")
                return {}
            time.sleep(1)
        for seed, conc in enumerate([1] + concs):  # the first run warms up
            res: list = []
            t0 = time.perf_counter()
            threads = [threading.Thread(target=vllm_stream, args=(port, p, args.new_tokens, t0, res))
                       for p in prompts(conc, args.prompt_len, 100 + seed)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if seed:
                out[conc] = (sum(n for _f, n in res) / (time.perf_counter() - t0),
                             statistics.median(f for f, _n in res))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="the demo model's size instead of Qwen3-0.6B's")
    ap.add_argument("--dry-run", action="store_true", help="CPU, small model, tiny sizes: seconds")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--vllm-start-s", type=float, default=180)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    if args.dry_run:
        args.device, args.small, args.new_tokens, args.prompt_len = "cpu", True, 4, 16
        args.concurrency, args.vllm_start_s = "1,4", 60
    import torch

    from inference.engine.runner import ModelRunner

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device visible to torch; use --dry-run or --device cpu")
        return 2
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    concs = [int(c) for c in args.concurrency.split(",")]
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check-"))
    args.work = str(work)
    model_dir = work / "model"
    t = time.perf_counter()
    build_model(model_dir, args.small, dtype)
    print(f"model: {'small' if args.small else 'Qwen3-0.6B config'}, random weights, {dtype}, at {model_dir} "
          f"({time.perf_counter() - t:.1f} s)")
    RUNNERS.append(ModelRunner(str(model_dir), device=args.device, dtype=dtype, max_model_len=2048,
                               prefix_cache_mb=0))
    ours(model_dir, args, min(concs), 99)  # warm-up
    mine = {c: ours(model_dir, args, c, 100 + i) for i, c in enumerate(concs)}
    for c, (tps, ttft) in mine.items():
        print(f"ours  c={c:3d}: {tps:9.1f} output tokens/s, TTFT p50 {ttft * 1e3:8.1f} ms")
    RUNNERS.clear()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    theirs = vllm(model_dir, args, concs)
    for c, (tps, ttft) in theirs.items():
        print(f"vLLM  c={c:3d}: {tps:9.1f} output tokens/s, TTFT p50 {ttft * 1e3:8.1f} ms; "
              f"ours/vLLM tokens/s {mine[c][0] / tps:.2f}, TTFT {mine[c][1] / max(ttft, 1e-9):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
