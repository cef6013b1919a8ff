"""``POST /v1/chat/completions`` (OpenAI chat API; shapes as reference/vllm_frontend.md §9)."""

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
    chat_template_for,
    check_prompt_chars,
    link,
    eos_ids_of,
    load_tokenizer,
    message_chars,
    public_finish_reason,
    request_scope,
    resolve_model,
    to_request_error,
    usage_dict,
    vocab_size_of,
)
from gateway.http import GatewayConsumer
from gateway.logprobs import chat_logprobs
from gateway.media import attach_media, render_chat_media
from inference.input_processor import generation_defaults, new_internal_id, process_inputs
from inference.protocol.openai import ChatCompletionRequest, RequestValidationError


def render_payload(model: dict, req: ChatCompletionRequest) -> dict:
    """The ``inference.render_chat`` task payload for ``req`` on ``model``."""
    add_generation_prompt = bool(req.add_generation_prompt)
    if req.continue_final_message:
        add_generation_prompt = False
    return {
        "tokenizer_dir": model["tokenizer_dir"],
        "messages": [m.model_dump(exclude_unset=True) for m in req.messages],
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": bool(req.continue_final_message),
        "tools": [t.model_dump(exclude_unset=True) for t in req.tools] if req.tools else None,
        "documents": req.documents,
        "chat_template": chat_template_for(model, req),
        "client_chat_template": req.chat_template is not None,  # never rendered inline (gateway.render.runs_inline)
        "chat_template_kwargs": req.chat_template_kwargs or None,
        "add_special_tokens": bool(req.add_special_tokens),
        # issue 14: control-token strings in request text stay text unless the operator opted this model out
        "allow_control_tokens": bool(model.get("allow_control_tokens_in_content")),
    }


class ChatCompletionsConsumer(GatewayConsumer):
    """Chat completions, streaming (SSE) and not. Every check runs before the first byte."""

    async def handle_request(self, body: bytes) -> None:
        arrival = time.time()
        ctx, req, external_id = await authenticated_request(self, body, ChatCompletionRequest, "chatcmpl-")
        async with request_scope("chat.completions", new_internal_id(external_id), arrival, ctx, req.model,
                                 req.n or 1) as scope:
            model = await resolve_model(ctx, req.model)
            # the key's limits before any work (render, images): estimated tokens, settled on the real count
            scope.grant = await key_limits_acquire_tokens(self, ctx, key_limits_estimate(
                model, len(body), req.n or 1, req.requested_max_tokens[0]))
            scope.reservation = await admission_precheck(model, scope.recorder.request_id, req.n or 1, len(body))
            tokenizer = await load_tokenizer(model)
            check_prompt_chars(model, tokenizer, message_chars(req.messages), "messages")
            salt = cache_salt_for(ctx, req.cache_salt)
            rendered = await render_chat_media(model, render_payload(model, req), cache_salt=salt,
                                               tenant_id=ctx.tenant_id)  # images: + queue mm
            try:
                processed = process_inputs(
                    req, external_id=external_id, prompt_token_ids=rendered["prompt_token_ids"],
                    prompt_param="messages", max_model_len=model["max_model_len"],
                    vocab_size=vocab_size_of(tokenizer, model), defaults=generation_defaults(model["model_dir"]),
                    client_id=link().client_id, arrival_time=arrival, eos_token_ids=eos_ids_of(tokenizer),
                    logprobs=(req.top_logprobs or 0) if req.logprobs else None, cache_salt=salt)
            except RequestValidationError as exc:
                raise to_request_error(exc) from None
            await admission_reserve(scope.reservation, processed)
            attach_media(processed, rendered)
            run = scope.run = GenerationRun(
                model=model, processed=processed, tokenizer=tokenizer, stop=req.stop,
                include_stop_str_in_output=bool(req.include_stop_str_in_output),
                skip_special_tokens=req.skip_special_tokens is not False, arrival_time=arrival,
                reservation=scope.reservation)
            await run.start()
            if req.stream:
                await self._stream(req, run, external_id, int(arrival), tokenizer)
            else:
                await self._complete(req, run, external_id, int(arrival), tokenizer)

    async def _complete(self, req, run: GenerationRun, external_id: str, created: int, tokenizer) -> None:
        async for _ in run.deltas():
            pass
        error = run.error_message()
        if error:
            raise ApiError(503, error, "server_error", None, "engine_error", [("retry-after", "1")])
        choices = []
        for c in run.choices:
            choices.append({
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "tool_calls": []},
                "logprobs": chat_logprobs(tokenizer, c.token_ids, c.logprobs, req.top_logprobs or 0)
                if req.logprobs else None,
                "finish_reason": public_finish_reason(c.finish_reason),
                "stop_reason": c.stop_reason,
                **({"token_ids": c.token_ids} if req.return_token_ids else {}),
            })
        await self.send_json(200, {
            "id": external_id, "object": "chat.completion", "created": created,
            "model": run.model["served_model_name"], "choices": choices,
            "usage": usage_dict(run.prompt_tokens, run.completion_tokens, run.num_cached_tokens),
            "system_fingerprint": None,
            **({"prompt_token_ids": run.processed.prompt_token_ids} if req.return_token_ids else {}),
        })

    async def _stream(self, req, run: GenerationRun, external_id: str, created: int, tokenizer) -> None:
        model_name = run.model["served_model_name"]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices, usage=None):
            body = {"id": external_id, "object": "chat.completion.chunk", "created": created,
                    "model": model_name, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return body

        await self.start_sse()
        for c in run.choices:
            await self.send_event(chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]))
        seen_logprobs = {c.index: 0 for c in run.choices}
        async for d in run.deltas():
            state = run.choices[d.index]
            if state.finish_reason == "error":
                break
            if d.finish_reason is None and not d.text:
                continue  # text held back (partial character or possible stop string)
            choice = {"index": d.index, "delta": {"content": d.text} if d.text else {},
                      "logprobs": None, "finish_reason": public_finish_reason(d.finish_reason)}
            if req.logprobs:
                start = seen_logprobs[d.index]
                choice["logprobs"] = chat_logprobs(tokenizer, state.token_ids[start:], state.logprobs[start:],
                                                   req.top_logprobs or 0)
                seen_logprobs[d.index] = len(state.token_ids)
            if d.finish_reason is not None:
                choice["stop_reason"] = d.stop_reason
            await self.send_event(chunk([choice]))
        error = run.error_message()
        if error:
            raise ApiError(503, error, "server_error", None, "engine_error")
        if include_usage:
            await self.send_event(chunk([], usage_dict(run.prompt_tokens, run.completion_tokens,
                                                       run.num_cached_tokens)))
        await self.end_sse()
