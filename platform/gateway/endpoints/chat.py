"""``POST /v1/chat/completions`` (OpenAI chat API; vLLM's ``vllm/entrypoints/openai/serving_chat.py`` shapes):
the request path of docs/ARCHITECTURE.md §2, step by step (docs/request_path.md)."""

from __future__ import annotations

from typing import Any

from gateway.http import GatewayConsumer
from gateway.logprobs import chat_logprobs
from gateway.pipeline import conversation, responses
from gateway.pipeline.engine import GenerationRun
from gateway.pipeline.usage import public_finish_reason
from inference.api.chat_output import ChatDelta, ChatOutputParser
from inference.api.output_processor import ChoiceDelta, ChoiceState
from inference.protocol.openai import ChatCompletionRequest
from inference.renderer.tokenizer_cache import LoadedTokenizer


CHAT = conversation.Route("chat.completions", "chatcmpl-")
"""The route's usage name and id prefix; the key from ``Authorization: Bearer``, errors in OpenAI's envelope."""


class ChatCompletionsConsumer(GatewayConsumer):
    """Chat completions, streaming (SSE) and not. Every check runs before the first byte."""

    async def handle_request(self, body: bytes) -> None:
        async with conversation.opened(self, body, CHAT, ChatCompletionRequest) as conv:
            req = conv.pre.req  # the internal request is the body itself
            started = await conversation.start(self, conv, req, size=len(body))
            run, tokenizer = started.run, started.tokenizer
            if req.stream:
                await self._stream(req, run, conv.pre.external_id, int(conv.arrival), tokenizer)
            else:
                await responses.complete(run)
                await self.send_json(200, chat_completion_body(req, run, conv.pre.external_id, int(conv.arrival),
                                                               tokenizer))

    async def _stream(self, req: ChatCompletionRequest, run: GenerationRun, external_id: str, created: int,
                      tokenizer: LoadedTokenizer) -> None:
        include_usage, continuous = responses.usage_options(req.stream_options)
        cursor = responses.LogprobCursor(run)
        envelope = responses.chunk_envelope("chat.completion.chunk", external_id, created, run, include_usage,
                                            continuous)
        parsers = choice_parsers(run)

        def choice_of(d: ChoiceDelta, state: ChoiceState) -> list[dict[str, Any]] | None:
            parser = parsers[d.index]
            out = parser.push(d.text) if d.text else ChatDelta()
            if d.finish_reason is not None:
                tail = parser.finish()
                out = ChatDelta(out.reasoning + tail.reasoning, out.content + tail.content, out.calls + tail.calls)
            deltas = out.stream_deltas(with_reasoning=parser.reasoning is not None)
            if d.finish_reason is None and not deltas:
                return None  # text held back (partial character, possible stop string or markup)
            choices: list[dict[str, Any]] = [{"index": d.index, "delta": delta, "logprobs": None,
                                              "finish_reason": None} for delta in deltas or [{}]]
            if req.logprobs:
                ids, lps = cursor.take(state)
                choices[0]["logprobs"] = chat_logprobs(tokenizer, ids, lps, req.top_logprobs or 0)
            if d.finish_reason is not None:
                choices[-1]["finish_reason"] = public_finish_reason(parser.finish_reason(d.finish_reason))
                choices[-1]["stop_reason"] = d.stop_reason
            return choices

        first = [envelope([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}], None) for c in run.choices]
        if req.echo_text:  # the echoed assistant prefix: each choice's first content delta (vLLM)
            first += [envelope([{"index": c.index, "delta": {"content": req.echo_text}, "logprobs": None,
                                 "finish_reason": None}], None) for c in run.choices]
        await responses.stream(self, run, envelope, choice_of, include_usage=include_usage, first_events=first,
                               usage_of=lambda r: responses.run_usage(r, reasoning_tokens(r, parsers)))


def choice_parsers(run: GenerationRun) -> list[ChatOutputParser]:
    """One ``ChatOutputParser`` per choice of ``run`` (reasoning, answer, tool calls; ``inference.api.chat_output``)."""
    return conversation.output_parsers(run)


def reasoning_tokens(run: GenerationRun, parsers: list[ChatOutputParser]) -> int | None:
    """``usage.completion_tokens_details.reasoning_tokens`` over all choices; ``None`` without a reasoning
    parser (the field is then left out, as vLLM does)."""
    counts = [p.reasoning_tokens(c.token_ids) for p, c in zip(parsers, run.choices)]
    return None if any(n is None for n in counts) else sum(n or 0 for n in counts)


def chat_completion_body(req: ChatCompletionRequest, run: GenerationRun, external_id: str, created: int,
                         tokenizer: LoadedTokenizer) -> dict[str, Any]:
    """The non-streaming ``chat.completion`` object of a finished run: each choice's text parsed at once into
    reasoning, content and tool calls (the same parsers a stream uses, fed the whole text)."""
    parsers = choice_parsers(run)
    choices = []
    for c, parser in zip(run.choices, parsers):
        parser.push(c.text)
        parser.finish()
        choices.append({
            "index": c.index,
            "message": {"role": "assistant", **parser.message_fields(req.echo_text)},
            "logprobs": chat_logprobs(tokenizer, c.token_ids, c.logprobs, req.top_logprobs or 0) if req.logprobs else None,
            "finish_reason": public_finish_reason(parser.finish_reason(c.finish_reason)),
            "stop_reason": c.stop_reason,
            **({"token_ids": c.token_ids} if req.return_token_ids else {}),
        })
    return {"id": external_id, "object": "chat.completion", "created": created, "model": run.model.served_model_name,
            "choices": choices, "usage": responses.run_usage(run, reasoning_tokens(run, parsers)),
            "system_fingerprint": None,
            **({"prompt_token_ids": run.processed.prompt_token_ids} if req.return_token_ids else {})}
