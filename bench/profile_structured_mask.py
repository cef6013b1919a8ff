"""Profile: where a constrained decode step's extra time goes (issue 16, the ≥ 0.9× throughput goal).

Runs the engine's own parts in this process, without Redis: a ``ModelRunner`` on the demo model with ``--n``
sequences of one prompt, each constrained by the long JSON schema of ``bench/structured.py``, and for
``--steps`` decode steps times every phase of one step: the forward (``runner.decode``), each part of building
the mask (llguidance ``fill_next_token_bitmask_par``, ``unpackbits``, the bool ``[B, vocab]`` allocation and
fill, the EOS fix-ups, ``torch.from_numpy``), the masked ``sample`` against an unmasked one on a copy of the same
logits, and ``consume_token`` (``SequenceGrammar.advance``); then the engine's ``GrammarMasker.mask`` as a whole,
and the forward alone against the forward with the next mask computed in a thread at the same time (does the
mask's work fit beside the forward on this machine's cores?).

    python bench/profile_structured_mask.py [--model-dir .cache/models/tiny-qwen3] [--n 16] [--steps 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import llguidance
import llguidance.torch
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.structured import EOS, LONG, PROMPT
from inference.engine.runner import ModelRunner, Sequence, make_rng
from inference.engine.structured import GrammarCompiler, GrammarMasker, SequenceGrammar
from inference.protocol.engine import EngineCoreRequest, SamplingParams


def make_seqs(runner: ModelRunner, comp: GrammarCompiler, n: int, spec: str | None) -> list[Sequence]:
    seqs = []
    for i in range(n):
        sp = SamplingParams(temperature=1.0, seed=i, max_tokens=10_000, eos_token_ids=EOS)
        req = EngineCoreRequest(request_id=f"r{i}", external_req_id=f"r{i}", prompt_token_ids=PROMPT,
                                sampling_params=sp, client_id="c", arrival_time=time.time())
        s = Sequence(request=req, queued_ts=0.0, rng=make_rng(i))
        runner.prepare(s)
        if spec is not None:
            s.grammar = SequenceGrammar(comp.compile("json", spec), [], frozenset(EOS))
            s.grammar.future.result()
            s.grammar.start()
        seqs.append(s)
    return seqs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=str(ROOT / ".cache/models/tiny-qwen3"))
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores, as the engine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    runner = ModelRunner(args.model_dir)
    comp = GrammarCompiler(args.model_dir, EOS, threads=2)
    masker = GrammarMasker(comp)
    tok = comp.tokenizer
    spec = json.dumps(LONG)
    seqs = make_seqs(runner, comp, args.n, spec)
    logits = runner.prefill(seqs)
    runner.sample(logits, seqs)  # warm
    t: dict[str, list[float]] = defaultdict(list)

    def clock(name: str, t0: float) -> float:
        t1 = time.perf_counter()
        t[name].append((t1 - t0) * 1e3)
        return t1

    for s in seqs:  # first tokens: a real masked sample
        s.output_token_ids.append(0)
    m = masker.mask([(i, s.grammar) for i, s in enumerate(seqs)], len(seqs), logits.shape[1], logits.device)
    toks, _ = runner.sample(logits, seqs, m)
    for s, tk in zip(seqs, toks):
        s.output_token_ids[-1] = tk
        assert s.grammar is not None and not s.grammar.advance(tk)
        s.num_computed = len(PROMPT)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        logits = runner.decode(seqs)
        for s in seqs:
            s.num_computed += 1
        t0 = clock("forward (runner.decode)", t0)
        b, width = logits.shape
        rows = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None and s.grammar.constraining]
        bitmask = llguidance.torch.allocate_token_bitmask(len(rows), tok.vocab_size)
        t0 = clock("old mask: allocate int32 bitmask", t0)
        llguidance.torch.fill_next_token_bitmask_par(masker.executor, [(g.matcher, j) for j, (_i, g) in
                                                                       enumerate(rows)], bitmask)
        t0 = clock("old mask: llguidance fill_next_token_bitmask_par", t0)
        n = min(width, tok.vocab_size)
        flags = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=n, bitorder="little")
        t0 = clock("old mask: np.unpackbits", t0)
        row_list = [i for i, _g in rows]
        disallowed = np.zeros((b, width), dtype=np.bool_)
        t0 = clock("old mask: np.zeros bool [B, vocab]", t0)
        disallowed[row_list, n:] = True
        disallowed[row_list, :n] = flags == 0
        t0 = clock("old mask: flags == 0 into the rows", t0)
        for i, g in rows:
            ids = [x for x in g.eos_ids if 0 <= x < width]
            if g.complete:
                disallowed[i] = True
                disallowed[i, ids] = False
            elif g.accepting():
                disallowed[i, ids] = False
        t0 = clock("old mask: complete/accepting EOS fix-ups", t0)
        dis_t = torch.from_numpy(disallowed).to(logits.device)
        t0 = clock("old mask: torch.from_numpy", t0)
        plain = logits.clone()
        t0 = time.perf_counter()
        runner.sample(plain, seqs)
        t0 = clock("sample unmasked (reference)", t0)
        logits.masked_fill_(dis_t, float("-inf"))
        t0 = clock("old apply: masked_fill_", t0)
        toks, _ = runner.sample(logits, seqs)
        t0 = clock("sample after the mask", t0)
        for s, tk in zip(seqs, toks):
            s.output_token_ids.append(tk)
            assert s.grammar is not None and not s.grammar.advance(tk)
        t0 = clock("consume_token (advance, all rows)", t0)
        t0 = time.perf_counter()
        gm = masker.mask([(i, s.grammar) for i, s in enumerate(seqs)], b, width, logits.device)
        t0 = clock("new: GrammarMasker.mask (next state)", t0)
        assert gm is not None
        gm.apply(plain)
        clock("new: GrammarMask.apply (add the bias)", t0)

    # forward alone vs forward while the next mask is computed in a thread
    def fill() -> None:
        bm = llguidance.torch.allocate_token_bitmask(len(seqs), tok.vocab_size)
        llguidance.torch.fill_next_token_bitmask_par(masker.executor, [(s.grammar.matcher, j) for j, s in
                                                                       enumerate(seqs) if s.grammar], bm)

    for _ in range(args.steps):
        t0 = time.perf_counter()
        runner.decode(seqs)
        clock("overlap: forward alone", t0)
        t0 = time.perf_counter()
        fill()
        clock("overlap: mask fill alone", t0)
        t0 = time.perf_counter()
        th = threading.Thread(target=fill)
        th.start()
        runner.decode(seqs)
        th.join()
        clock("overlap: forward + mask fill in a thread", t0)

    # whole steps, interleaved so that the machine's load weighs on each kind alike: unconstrained (forward +
    # sample), the old constrained step (mask built after the forward: bool mask, masked_fill_) and the new one
    # (mask built in the masker's thread during the forward, bias added)
    def old_mask(b: int, width: int) -> torch.Tensor:
        bm = llguidance.torch.allocate_token_bitmask(len(seqs), tok.vocab_size)
        llguidance.torch.fill_next_token_bitmask_par(masker.executor, [(s.grammar.matcher, j) for j, s in
                                                                       enumerate(seqs) if s.grammar], bm)
        n = min(width, tok.vocab_size)
        flags = np.unpackbits(bm.numpy().view(np.uint8), axis=1, count=n, bitorder="little")
        dis = np.zeros((b, width), dtype=np.bool_)
        dis[:, n:] = True
        dis[:, :n] = flags == 0
        return torch.from_numpy(dis)

    for k in range(3 * args.steps):
        kind = ("step: unconstrained", "step: old constrained", "step: new constrained")[k % 3]
        t0 = time.perf_counter()
        rows = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
        ahead = masker.submit(rows, len(seqs), runner.vocab_size, runner.device) if k % 3 == 2 else None
        logits = runner.decode(seqs)
        if k % 3 == 1:
            logits.masked_fill_(old_mask(*logits.shape), float("-inf"))
        elif ahead is not None:
            gm = ahead.result()
            assert gm is not None
            gm.apply(logits)
        toks, _ = runner.sample(logits, seqs)
        if k % 3:
            for s, tk in zip(seqs, toks):
                s.output_token_ids.append(tk)
                assert s.grammar is not None and not s.grammar.advance(tk)
        clock(kind, t0)
    u, o, nw = (statistics.median(t[f"step: {x}"]) for x in ("unconstrained", "old constrained",
                                                               "new constrained"))
    print(f"step p50 ms: unconstrained {u:.2f}, old constrained {o:.2f} ({u / o:.3f}x), "
          f"new constrained {nw:.2f} ({u / nw:.3f}x)")
    masker.shutdown()
    print(f"batch {args.n}, {args.steps} steps, torch threads {torch.get_num_threads()}, "
          f"load {os.getloadavg()[0]:.2f}; per step, ms: mean / p50 / max")
    for name, xs in t.items():
        print(f"  {name:55s} {statistics.mean(xs):7.3f} {statistics.median(xs):7.3f} {max(xs):7.3f}")
    comp.shutdown()
    return 0


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
