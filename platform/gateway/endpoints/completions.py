"""``POST /v1/completions`` (OpenAI legacy completions; vLLM's ``serving_completion.py`` shapes): the request
path of docs/ARCHITECTURE.md §2, step by step (docs/request_path.md).

``echo`` with ``logprobs``: the ``logprobs`` object covers the echoed prompt and then the completion, as OpenAI's
legacy endpoint and vLLM do; the prompt's first token has ``null`` logprobs (nothing predicts it), the others come
from the engine's prompt logprobs (``SamplingParams.prompt_logprobs`` = ``logprobs``), ``text_offset`` runs on
over both parts. Streamed, the echo chunk of a choice waits for its first output (which carries the prompt
logprobs) and holds the prompt text and its logprobs together with the first generated text.
"""

from __future__ import annotations

import time
from typing import Any, cast

from gateway.errors import engine_error
from gateway.http import GatewayConsumer
from gateway.logprobs import completion_logprobs
from gateway.pipeline import inputs, limits, preamble, rendering, responses
from gateway.clients import link
from gateway.pipeline.engine import GenerationRun
from gateway.pipeline.flow import admit_and_start, hold_before_render
from gateway.pipeline.scope import record_refusal, request_scope
from gateway.pipeline.usage import public_finish_reason
from inference.api.admission import estimate_prompt_tokens
from inference.api.input_processor import generation_defaults, merge_batch, new_internal_id
from inference.api.output_processor import ChoiceDelta, ChoiceState
from inference.protocol.openai import CompletionRequest
from inference.renderer.tokenizer_cache import LoadedTokenizer


class CompletionsConsumer(GatewayConsumer):
    """Text completions, streaming (SSE) and not."""

    async def handle_request(self, body: bytes) -> None:
        arrival = time.time()
        pre = await preamble.preamble(self, body, CompletionRequest, "cmpl-",
                                      on_refused=record_refusal("completions"))
        ctx, req, n = pre.ctx, pre.req, pre.req.n or 1
        prompts = req.prompts  # one, or a batch: P prompts, n choices each
        ids_prompt = not isinstance(prompts[0], str)  # token ids: sizes are exact; text: UTF-8 bytes bound
        sizes = [len(p) if ids_prompt else len(cast(str, p).encode()) for p in prompts]
        max_tokens = req.requested_max_tokens[0]
        async with request_scope("completions", new_internal_id(pre.external_id), arrival, ctx, req.model,
                                 n * len(prompts), grant=pre.grant) as scope:
            model = await preamble.resolve_model(ctx, req.model, generate=True)
            exact, size = ids_prompt, sizes[0]
            if req.is_batch:  # admission's pre-check: the prompts' bounds summed, spread evenly over the choices
                exact, size = True, -(-sum(estimate_prompt_tokens(s, model.max_model_len, exact=ids_prompt)
                                           for s in sizes) // len(sizes))
            await hold_before_render(self, scope, ctx, model, n=n * len(prompts), exact=exact, size=size,
                                     max_tokens=max_tokens, request_priority=req.priority,
                                     tokens=limits.estimate_prompts(model, sizes, n, max_tokens, exact=ids_prompt)
                                     if req.is_batch else None, constrained=inputs.asks_for_constraint(req))
            structured = await inputs.structured_constraint(req, ctx)
            tokenizer = await rendering.load_tokenizer(model)
            if not ids_prompt:
                rendering.check_prompt_chars(model, tokenizer, max(len(cast(str, p)) for p in prompts), "prompt")
            salt, defaults = inputs.cache_salt_for(ctx, req.cache_salt), generation_defaults(model.model_dir)
            rendered = await rendering.prompt_ids_for(model, req, salt)
            processed = merge_batch([inputs.process(
                req, model, tokenizer, external_id=pre.external_id, prompt_token_ids=prompt_ids,
                prompt_param="prompt", client_id=link().client_id, arrival_time=arrival, logprobs=req.logprobs,
                cache_salt=salt, defaults=defaults, structured=structured,
                prompt_logprobs=req.logprobs if req.echo else None) for prompt_ids, _ in rendered])
            echo_texts = [(text if text is not None else tokenizer.decode(ids, False)) if req.echo else ""
                          for ids, text in rendered]
            run = await admit_and_start(scope, model, tokenizer, processed, stop=req.stop,
                                        include_stop_str_in_output=bool(req.include_stop_str_in_output),
                                        skip_special_tokens=req.skip_special_tokens is not False,
                                        arrival_time=arrival)
            if req.stream:
                await self._stream(req, run, pre.external_id, int(arrival), tokenizer, echo_texts)
            else:
                await responses.complete(run)
                await self.send_json(200, completion_body(req, run, pre.external_id, int(arrival), tokenizer,
                                                          echo_texts))

    async def _stream(self, req: CompletionRequest, run: GenerationRun, external_id: str, created: int,
                      tokenizer: LoadedTokenizer, echo_texts: list[str]) -> None:
        include_usage, continuous = responses.usage_options(req.stream_options)
        cursor = responses.LogprobCursor(run)
        envelope = responses.chunk_envelope("text_completion", external_id, created, run, include_usage, continuous)
        echo_pending = {c.index for c in run.choices} if req.echo and req.logprobs is not None else set()
        offsets = {c.index: 0 for c in run.choices}  # text_offset runs on across a choice's chunks

        def choice_of(d: ChoiceDelta, state: ChoiceState) -> dict[str, Any] | None:
            echo_now = d.index in echo_pending
            if d.finish_reason is None and not d.text and not echo_now:
                return None
            choice: dict[str, Any] = {"index": d.index, "text": d.text, "logprobs": None,
                      "finish_reason": public_finish_reason(d.finish_reason), "stop_reason": d.stop_reason}
            if req.logprobs is not None:
                ids, lps = cursor.take(state)
                if echo_now:
                    echo_pending.discard(d.index)
                    choice["text"] = echo_texts[state.prompt_index] + d.text
                    ids, lps = run.state.prompt_of(state) + ids, prompt_entries(run, state) + lps
                lp = completion_logprobs(tokenizer, ids, lps, offsets[d.index])
                if lp["tokens"]:
                    offsets[d.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                choice["logprobs"] = lp
            return choice

        first = [envelope([{"index": c.index, "text": echo_texts[c.prompt_index], "logprobs": None,
                            "finish_reason": None, "stop_reason": None}], None)
                 for c in run.choices] if req.echo and not echo_pending else []
        await responses.stream(self, run, envelope, choice_of, include_usage=include_usage, first_events=first)


def prompt_entries(run: GenerationRun, state: ChoiceState) -> list[Any]:
    """The engine's prompt logprob entries of one choice, one per token of its prompt (the first ``None``). An
    engine that sent none (or not one per token) fails the request (``ApiError`` 503 ``engine_error``) rather
    than giving a ``logprobs`` object that silently covers only part of the text."""
    entries = state.prompt_logprobs
    if entries is None or len(entries) != len(run.state.prompt_of(state)):
        raise engine_error("The engine returned no prompt logprobs for echo with logprobs", retry_after=True)
    return entries


def _logprobs(req: CompletionRequest, run: GenerationRun, c: ChoiceState,
              tokenizer: LoadedTokenizer) -> dict[str, Any] | None:
    if req.logprobs is None:
        return None
    if req.echo:  # the echoed prompt's tokens, then the completion's, offsets running on (OpenAI, vLLM)
        return completion_logprobs(tokenizer, run.state.prompt_of(c) + c.token_ids,
                                   prompt_entries(run, c) + c.logprobs)
    return completion_logprobs(tokenizer, c.token_ids, c.logprobs)


def completion_body(req: CompletionRequest, run: GenerationRun, external_id: str, created: int,
                    tokenizer: LoadedTokenizer, echo_texts: list[str]) -> dict[str, Any]:
    """The non-streaming ``text_completion`` object of a finished run (``echo_texts``: per prompt, the text
    echoed before its choices' output, ``""`` without ``echo``). With ``return_token_ids`` every choice has its
    ``token_ids`` and its prompt's ``prompt_token_ids`` (vLLM's shape); a single prompt's ids are also given at
    the top level."""
    choices = [{
        "index": c.index,
        "text": echo_texts[c.prompt_index] + c.text,
        "logprobs": _logprobs(req, run, c, tokenizer),
        "finish_reason": public_finish_reason(c.finish_reason),
        "stop_reason": c.stop_reason,
        **({"token_ids": c.token_ids, "prompt_token_ids": run.state.prompt_of(c)} if req.return_token_ids else {}),
    } for c in run.choices]
    return {"id": external_id, "object": "text_completion", "created": created,
            "model": run.model.served_model_name, "choices": choices, "usage": responses.run_usage(run),
            "system_fingerprint": None,
            **({"prompt_token_ids": run.processed.prompt_token_ids}
               if req.return_token_ids and not req.is_batch else {})}
