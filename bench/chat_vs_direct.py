"""Issue 2 benchmark: 16 concurrent streaming chats through the whole platform, through the engine link alone, and
through ``transformers`` ``generate``.

All three sides run 16 prompts of the same shape (the Qwen3 chat template, real tokenizer) on the same demo model
in this one run, each generating exactly ``--max-tokens`` tokens (EOS ignored, greedy, so the work is identical):

* platform: a live platform (Redis or ``REDIS_URL``, Celery workers, engine, uvicorn) started here; 16 clients
  stream at once over HTTP (a lean httpx SSE reader, ``bench.lib.chat_stream``); TTFT = time to the first content
  chunk.
* engine: the same platform's engine replica, sent the prompts' token ids straight over its Redis link by the api's
  own link client (``inference.api.engine_client.EngineLink``), 16 at once: the platform less HTTP, authentication,
  admission, rendering and output processing; TTFT = time to the first output carrying a token. (This side was
  ``bench/engine_direct.py``.)
* direct: one left-padded batch through ``model.generate`` in this process, after the platform has stopped; TTFT =
  time until the first token is chosen (a logits processor records the first call).

Every side gets the same treatment: one warm-up, then ``--rounds`` measured rounds, each with prompts no other round
or warm-up used (so the engine's prefix cache never serves a measured prompt: the engine side's prompts are its own,
the direct side reuses the platform's, it has no such cache), and the same statistic (the mean over rounds of each
figure). The platform and engine sides take turns within a round, each round starting with the other. Prints TTFT
p50/p99, output tokens/s and the ratios platform/direct, engine/direct and platform/engine (what the frontend costs).
Usage: ``.venv/bin/python bench/chat_vs_direct.py [--concurrency 16] [--max-tokens 64] [--rounds 2]``
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from bench.lib.chat_stream import mean_of, prompts, run_platform
from bench.lib.stats import pct
from harness.assets import DEMO_MODEL, MODEL_DIR
from harness.live_platform import LivePlatform, start_platform
from inference.api.engine_client import EngineLink
from inference.protocol.engine import EngineCoreRequest, SamplingParams


def prompt_ids(tok, convs: list[list[dict]]) -> list[list[int]]:
    """The token ids of each conversation under the model's chat template, with the generation prompt."""
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
    return [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]


async def run_engine(live: LivePlatform, prompts_ids: list[list[int]], max_tokens: int,
                     model: str = DEMO_MODEL) -> dict:
    """Send every prompt (token ids) at once, one request each, to ``live``'s engine replica of ``model`` through the
    api's own link client, and read each to its end; the figures ``run_platform`` gives (``wall_s``, ``tokens``,
    ``tok_s``, ``ttft_p50``, ``ttft_p99``). ``RuntimeError`` when the engine answers a request with an error."""
    link = EngineLink.for_current_process(live.redis_url, live.prefix)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def one(ids: list[int]) -> tuple[float | None, int]:
        rid = f"bench-{uuid.uuid4().hex[:12]}"
        req = EngineCoreRequest(request_id=rid, external_req_id=rid, prompt_token_ids=ids, sampling_params=params,
                                client_id=link.client_id, arrival_time=time.time())
        queue = (await link.add_requests(model, [req]))[rid]
        first, n = None, 0
        try:
            while True:
                out = await asyncio.wait_for(queue.get(), 300)
                if out.new_token_ids and first is None:
                    first = time.perf_counter() - t0
                n += len(out.new_token_ids)
                if out.finish_reason is not None:
                    if out.error:
                        raise RuntimeError(f"engine error: {out.error}")
                    return first, n
        finally:
            link.release(rid)

    try:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(ids) for ids in prompts_ids))
        wall = time.perf_counter() - t0
    finally:
        await link.close()
    ttfts = [first for first, _ in results if first is not None]
    tokens = sum(n for _, n in results)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "ttft_p50": pct(ttfts, 0.5),
            "ttft_p99": pct(ttfts, 0.99)}


def run_direct(rounds: list, warm, max_tokens: int) -> list[dict]:
    """One warm-up batch (``warm``), then one measured batch per element of ``rounds`` (lists of
    conversations); returns one result per round."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    model.eval()

    def batch_of(convs):
        texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
        return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    with torch.inference_mode():  # warm-up
        model.generate(**batch_of(warm), max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
    return [_direct_round(model, tok, batch_of(convs), max_tokens) for convs in rounds]


def _direct_round(model, tok, batch, max_tokens: int) -> dict:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstCall(LogitsProcessor):
        def __init__(self):
            self.t = None

        def __call__(self, input_ids, scores):
            if self.t is None:
                self.t = time.perf_counter()
            return scores

    first = FirstCall()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id, logits_processor=LogitsProcessorList([first]))
    wall = time.perf_counter() - t0
    tokens = (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    ttft = first.t - t0
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "ttft_p50": ttft, "ttft_p99": ttft}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2,
                    help="measured rounds per side, after one warm-up; each round's prompts are new")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    warm = prompts(args.concurrency, "warm-up")
    rounds = [prompts(args.concurrency, f"round {r + 1}") for r in range(args.rounds)]
    engine_warm = prompt_ids(tok, prompts(args.concurrency, "engine warm-up"))
    engine_rounds = [prompt_ids(tok, prompts(args.concurrency, f"engine round {r + 1}")) for r in range(args.rounds)]

    live = start_platform(Path(tempfile.mkdtemp(prefix="bench-")))
    runs: dict[str, list[dict]] = {"platform": [], "engine": []}
    try:
        asyncio.run(run_platform(live.base_url, live.api_key, warm, 4))  # warm tokenizer/template caches
        asyncio.run(run_engine(live, engine_warm, 4))
        for r in range(args.rounds):  # the two sides take turns, each round starting with the other
            for name in ("platform", "engine")[r % 2:] + ("platform", "engine")[:r % 2]:
                side = run_platform(live.base_url, live.api_key, rounds[r], args.max_tokens) if name == "platform" \
                    else run_engine(live, engine_rounds[r], args.max_tokens)
                runs[name].append(asyncio.run(side))
    finally:
        live.stop()
    direct_runs = run_direct(rounds, warm, args.max_tokens)
    means = {"platform": mean_of(runs["platform"]), "engine": mean_of(runs["engine"]), "direct": mean_of(direct_runs)}

    print(f"\n{args.concurrency} concurrent streaming chats, {args.max_tokens} new tokens each, demo model, CPU; "
          f"mean of {args.rounds} round(s) per side, fresh prompts each round")
    print(f"{'':10} {'TTFT p50 s':>11} {'TTFT p99 s':>11} {'tokens/s':>10} {'wall s':>8}")
    for name, r in means.items():
        print(f"{name:10} {r['ttft_p50']:11.3f} {r['ttft_p99']:11.3f} {r['tok_s']:10.1f} {r['wall_s']:8.2f}")
    for a, b in (("platform", "direct"), ("engine", "direct"), ("platform", "engine")):
        print(f"ratio {a}/{b}: tokens/s {means[a]['tok_s'] / means[b]['tok_s']:.2f}x, "
              f"TTFT p50 {means[a]['ttft_p50'] / means[b]['ttft_p50']:.2f}x")


if __name__ == "__main__":
    main()
