"""``POST /v1/completions`` (OpenAI legacy completions; shapes as reference/vllm_frontend.md §9)."""

from __future__ import annotations

import time

from gateway.errors import ApiError
from gateway.generation import (
    GenerationRun,
    admission_precheck,
    authenticated_request,
    admission_reserve,
    cache_salt_for,
    key_limits_acquire_tokens,
    key_limits_estimate,
    call_render,
    check_prompt_chars,
    link,
    eos_ids_of,
    load_tokenizer,
    public_finish_reason,
    request_scope,
    resolve_model,
    to_request_error,
    usage_dict,
    vocab_size_of,
)
from gateway.http import GatewayConsumer
from gateway.logprobs import completion_logprobs
from inference.input_processor import generation_defaults, new_internal_id, process_inputs
from inference.protocol.openai import CompletionRequest, RequestValidationError


async def prompt_ids_for(model: dict, req: CompletionRequest) -> tuple[list[int], str | None]:
    """``(prompt_token_ids, prompt_text)``: token-id prompts pass through; text is tokenized on a worker."""
    if isinstance(req.prompt, list):
        return list(req.prompt), None
    result = await call_render("inference.tokenize_prompt", {
        "tokenizer_dir": model["tokenizer_dir"], "prompt": req.prompt,
        "add_special_tokens": req.add_special_tokens is not False,
    })
    return result["prompt_token_ids"], req.prompt


class CompletionsConsumer(GatewayConsumer):
    """Text completions, streaming (SSE) and not."""

    async def handle_request(self, body: bytes) -> None:
        arrival = time.time()
        ctx, req, external_id = await authenticated_request(self, body, CompletionRequest, "cmpl-")
        async with request_scope("completions", new_internal_id(external_id), arrival, ctx, req.model,
                                 req.n or 1) as scope:
            model = await resolve_model(ctx, req.model)
            prompt_size = len(req.prompt) if isinstance(req.prompt, list) else len(req.prompt.encode())
            # the key's limits before any work (tokenizing): estimated tokens, settled on the real count
            scope.grant = await key_limits_acquire_tokens(self, ctx, key_limits_estimate(
                model, prompt_size, req.n or 1, req.requested_max_tokens[0], exact=isinstance(req.prompt, list)))
            scope.reservation = await admission_precheck(  # token-id prompts: exact; text: UTF-8 bytes bound
                model, scope.recorder.request_id, req.n or 1,
                len(req.prompt) if isinstance(req.prompt, list) else len(req.prompt.encode()),
                exact=isinstance(req.prompt, list))
            tokenizer = await load_tokenizer(model)
            check_prompt_chars(model, tokenizer, len(req.prompt) if isinstance(req.prompt, str) else 0, "prompt")
            prompt_ids, prompt_text = await prompt_ids_for(model, req)
            try:
                processed = process_inputs(
                    req, external_id=external_id, prompt_token_ids=prompt_ids, prompt_param="prompt",
                    max_model_len=model["max_model_len"], vocab_size=vocab_size_of(tokenizer, model),
                    defaults=generation_defaults(model["model_dir"]), client_id=link().client_id,
                    arrival_time=arrival, eos_token_ids=eos_ids_of(tokenizer), logprobs=req.logprobs,
                    cache_salt=cache_salt_for(ctx, req.cache_salt))
            except RequestValidationError as exc:
                raise to_request_error(exc) from None
            await admission_reserve(scope.reservation, processed)
            echo_text = ""
            if req.echo:
                echo_text = prompt_text if prompt_text is not None else tokenizer.decode(prompt_ids, False)
            run = scope.run = GenerationRun(
                model=model, processed=processed, tokenizer=tokenizer, stop=req.stop,
                include_stop_str_in_output=bool(req.include_stop_str_in_output),
                skip_special_tokens=req.skip_special_tokens is not False, arrival_time=arrival,
                reservation=scope.reservation)
            await run.start()
            if req.stream:
                await self._stream(req, run, external_id, int(arrival), tokenizer, echo_text)
            else:
                await self._complete(req, run, external_id, int(arrival), tokenizer, echo_text)

    async def _complete(self, req, run: GenerationRun, external_id, created, tokenizer, echo_text) -> None:
        async for _ in run.deltas():
            pass
        error = run.error_message()
        if error:
            raise ApiError(503, error, "server_error", None, "engine_error", [("retry-after", "1")])
        choices = [{
            "index": c.index,
            "text": echo_text + c.text,
            "logprobs": completion_logprobs(tokenizer, c.token_ids, c.logprobs, len(echo_text))
            if req.logprobs is not None else None,
            "finish_reason": public_finish_reason(c.finish_reason),
            "stop_reason": c.stop_reason,
            **({"token_ids": c.token_ids} if req.return_token_ids else {}),
        } for c in run.choices]
        await self.send_json(200, {
            "id": external_id, "object": "text_completion", "created": created,
            "model": run.model["served_model_name"], "choices": choices,
            "usage": usage_dict(run.prompt_tokens, run.completion_tokens, run.num_cached_tokens),
            "system_fingerprint": None,
            **({"prompt_token_ids": run.processed.prompt_token_ids} if req.return_token_ids else {}),
        })

    async def _stream(self, req, run: GenerationRun, external_id, created, tokenizer, echo_text) -> None:
        model_name = run.model["served_model_name"]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices, usage=None):
            body = {"id": external_id, "object": "text_completion", "created": created, "model": model_name,
                    "choices": choices}
            if include_usage:
                body["usage"] = usage
            return body

        await self.start_sse()
        if echo_text:
            for c in run.choices:
                await self.send_event(chunk([{"index": c.index, "text": echo_text, "logprobs": None,
                                              "finish_reason": None, "stop_reason": None}]))
        seen = {c.index: 0 for c in run.choices}
        async for d in run.deltas():
            state = run.choices[d.index]
            if state.finish_reason == "error":
                break
            if d.finish_reason is None and not d.text:
                continue
            choice = {"index": d.index, "text": d.text, "logprobs": None,
                      "finish_reason": public_finish_reason(d.finish_reason), "stop_reason": d.stop_reason}
            if req.logprobs is not None:
                start = seen[d.index]
                choice["logprobs"] = completion_logprobs(tokenizer, state.token_ids[start:],
                                                         state.logprobs[start:])
                seen[d.index] = len(state.token_ids)
            await self.send_event(chunk([choice]))
        error = run.error_message()
        if error:
            raise ApiError(503, error, "server_error", None, "engine_error")
        if include_usage:
            await self.send_event(chunk([], usage_dict(run.prompt_tokens, run.completion_tokens,
                                                       run.num_cached_tokens)))
        await self.end_sse()
