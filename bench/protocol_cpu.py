"""CPU per request of the protocol adapters against Chat Completions, for the same work, in one run (issue 41).

Each side sends the same conversations (the same prompt lengths: each request's number, four digits, in its text, a
number range per side so no side reads another's prefix cache), greedy, ``--max-tokens`` output tokens, the model's
thinking off on every side (the Messages API's default; the chat side says ``enable_thinking: false``), so every side
renders the same prompt and the engine does the same work. The sides take turns (``--rounds`` rounds, the order
alternating), each a bounded load of ``--requests`` requests from ``--clients`` concurrent clients, streamed and not
(``--modes``). Counted: the CPU (user + system, ``/proc/<pid>/stat``) of the api process, where the adapters run,
and of the whole platform (api, render and usage workers, beat, engine, Redis), per request; the ratio of each side
to chat in the same mode is the figure (goal: at most 1.05).

Before timing, each side's greedy output is checked to equal the chat side's on one prompt (the same work).

Sides: ``chat`` (``POST /v1/chat/completions``), ``messages`` (``POST /v1/messages``). A new adapter adds a ``Side``.

Usage::

    .venv/bin/python bench/protocol_cpu.py [--requests 200] [--clients 8] [--max-tokens 16] [--rounds 3]
        [--modes plain,stream] [--sides chat,messages] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from bench.lib.proc_cpu import proc_cpu_s
from harness.assets import DEMO_MODEL
from harness.live_platform import start_platform

PROMPT = "Request {n}: tell me a story about the sea, with ships, storms and a lighthouse keeper."


@dataclass
class Side:
    """One protocol: its path, its body for prompt ``text`` (``stream`` or not), its headers and how to read the text
    of a non-streamed answer."""

    name: str
    path: str
    body: Callable[[str, int, bool], dict[str, Any]]
    headers: Callable[[str], dict[str, str]]
    text: Callable[[dict[str, Any]], str]
    first: int  # its requests' numbers start here
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)  # mode -> {"api": s, "all": s, "n": requests}


def _chat_body(text: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": DEMO_MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, "chat_template_kwargs": {"enable_thinking": False}}


def _messages_body(text: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": DEMO_MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


SIDES = {
    "chat": lambda: Side("chat", "/v1/chat/completions", _chat_body, lambda k: {"authorization": f"Bearer {k}"},
                         lambda r: r["choices"][0]["message"]["content"], 1000),
    "messages": lambda: Side("messages", "/v1/messages", _messages_body,
                             lambda k: {"x-api-key": k, "anthropic-version": "2023-06-01"},
                             lambda r: "".join(b.get("text", "") for b in r["content"]), 2000),
}


def platform_pids(live) -> tuple[int, list[int]]:
    """``(api pid, every platform pid)``: the supervisor's children and their descendants."""
    api, pids = 0, []
    for child in live.sup.children:
        if child.proc is None:
            continue
        pids.append(child.proc.pid)
        if child.name == "api":
            api = child.proc.pid
        try:
            pids += [p.pid for p in psutil.Process(child.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return api, pids


def cpu_of(pids: list[int]) -> float:
    """CPU seconds of ``pids`` now (gone ones count 0)."""
    return sum(proc_cpu_s(p) or 0.0 for p in pids)


async def load(client: httpx.AsyncClient, side: Side, key: str, *, start: int, requests: int, clients: int,
               max_tokens: int, stream: bool) -> int:
    """``requests`` requests of ``side`` (numbers from ``start``), ``clients`` at a time; the count answered 200."""
    queue = list(range(start, start + requests))
    ok = 0

    async def worker() -> None:
        nonlocal ok
        while queue:
            n = queue.pop()
            body = side.body(PROMPT.format(n=n), max_tokens, stream)
            if stream:
                async with client.stream("POST", side.path, json=body, headers=side.headers(key)) as r:
                    async for _ in r.aiter_bytes():
                        pass
                    ok += r.status_code == 200
            else:
                r = await client.post(side.path, json=body, headers=side.headers(key))
                ok += r.status_code == 200

    await asyncio.gather(*(worker() for _ in range(clients)))
    return ok


async def same_work(client: httpx.AsyncClient, sides: list[Side], key: str, max_tokens: int) -> None:
    """Every side's greedy text equals the first side's on one prompt (else the comparison would be of other work)."""
    texts = {}
    for side in sides:
        r = await client.post(side.path, json=side.body(PROMPT.format(n=9999), max_tokens, False),
                              headers=side.headers(key))
        r.raise_for_status()
        texts[side.name] = side.text(r.json())
    if len(set(texts.values())) != 1:
        raise SystemExit(f"the sides do not do the same work: {texts}")


async def run(args: argparse.Namespace, live) -> list[Side]:
    """Warm up, check the work is the same, then the alternating measured rounds."""
    sides = [SIDES[name]() for name in args.sides.split(",")]
    modes = args.modes.split(",")
    api, pids = platform_pids(live)
    async with httpx.AsyncClient(base_url=live.base_url, timeout=120) as client:
        await same_work(client, sides, live.api_key, args.max_tokens)
        for side in sides:  # warm-up: tokenizer, template, code paths
            for mode in modes:
                await load(client, side, live.api_key, start=side.first + 900, requests=2 * args.clients,
                           clients=args.clients, max_tokens=args.max_tokens, stream=mode == "stream")
        for rnd in range(args.rounds):
            order = sides if rnd % 2 == 0 else sides[::-1]
            for mode in modes:
                for side in order:
                    before_api, before_all = cpu_of([api]), cpu_of(pids)
                    n = await load(client, side, live.api_key, start=side.first + rnd * args.requests % 800,
                                   requests=args.requests, clients=args.clients, max_tokens=args.max_tokens,
                                   stream=mode == "stream")
                    got = side.cpu.setdefault(mode, {"api": 0.0, "all": 0.0, "n": 0})
                    got["api"] += cpu_of([api]) - before_api
                    got["all"] += cpu_of(pids) - before_all
                    got["n"] += n
    return sides


def report(sides: list[Side]) -> dict[str, Any]:
    """Print the table; the figures as a dict."""
    out: dict[str, Any] = {}
    base = sides[0]
    print(f"{'side':<10}{'mode':<8}{'requests':>9}{'api ms/req':>12}{'all ms/req':>12}{'api x':>8}{'all x':>8}")
    for side in sides:
        for mode, got in side.cpu.items():
            ref = base.cpu[mode]
            api_ms, all_ms = 1000 * got["api"] / max(1, got["n"]), 1000 * got["all"] / max(1, got["n"])
            api_x = api_ms / (1000 * ref["api"] / max(1, ref["n"]))
            all_x = all_ms / (1000 * ref["all"] / max(1, ref["n"]))
            print(f"{side.name:<10}{mode:<8}{int(got['n']):>9}{api_ms:>12.2f}{all_ms:>12.2f}{api_x:>8.3f}{all_x:>8.3f}")
            out[f"{side.name}/{mode}"] = {"requests": got["n"], "api_ms_per_request": api_ms,
                                          "all_ms_per_request": all_ms, "api_ratio": api_x, "all_ratio": all_x}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per side, mode and round")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="plain,stream")
    ap.add_argument("--sides", default="chat,messages", help="the first is the baseline")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="protocol-cpu-") as tmp:
        live = start_platform(Path(tmp), max_model_len=512)
        try:
            figures = report(asyncio.run(run(args, live)))
        finally:
            live.stop()
    print(f"wall {time.monotonic() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
