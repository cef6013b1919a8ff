"""Chat bodies for ``POST /tokenize`` (one of about N tokens, multi-turn, on the sea) and the token ids a server
answers for one: the frontend benchmarks' load, checked identical on every server before it is timed."""

from __future__ import annotations

import time

import httpx


PARA = ("The sea was calm that morning, and the fishermen set out before dawn with their nets and their "
        "stories. Gulls circled above the harbour while the lighthouse keeper wrote in his log. ")


def chat_body(target_tokens: int) -> dict:
    """A multi-turn conversation of roughly ``target_tokens`` tokens (about 36 per paragraph)."""
    paras = max(1, target_tokens // 37)
    msgs = [{"role": "system", "content": "You are a helpful assistant who writes about the sea."}]
    per_turn = 6
    for i in range(0, paras, per_turn):
        msgs.append({"role": "user", "content": f"Part {i}: " + PARA * min(per_turn, paras - i)})
        msgs.append({"role": "assistant", "content": "Noted. " + PARA[:80]})
    msgs.append({"role": "user", "content": "Summarise everything above."})
    return {"messages": msgs, "add_generation_prompt": True}


def first_tokens(url: str, headers: dict, body: dict, tries: int = 10) -> list[int]:
    """The token ids of ``body`` from ``url``'s ``/tokenize``; a refusal (a render worker still loading its tokenizer
    on a busy machine) is tried again, up to ``tries`` times, 2 s apart."""
    for _ in range(tries - 1):
        out = httpx.post(url + "/tokenize", json=body, headers=headers, timeout=60).json()
        if "tokens" in out:
            return out["tokens"]
        time.sleep(2)
    return httpx.post(url + "/tokenize", json=body, headers=headers, timeout=60).json()["tokens"]
