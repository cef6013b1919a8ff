"""The generating endpoints' path, composed from the steps (docs/ARCHITECTURE.md §2): what chat, completions, generate
and embeddings share between the preamble and the response."""

from __future__ import annotations

from gateway.disconnect import raise_if_client_gone
from gateway.http import GatewayConsumer
from gateway.model_cache import ModelSnapshot
from gateway.pipeline import admission, inputs, limits, rendering
from gateway.pipeline.engine import GenerationRun
from gateway.pipeline.media import RenderedChat, render_chat_media
from gateway.pipeline.scope import RequestScope
from inference.api.admission import engine_priority
from inference.api.input_processor import ProcessedInput
from inference.protocol.openai import ChatCompletionRequest
from inference.renderer.tokenizer_cache import LoadedTokenizer
from tenancy.selectors import AuthContext


async def hold_before_render(consumer: GatewayConsumer, scope: RequestScope, ctx: AuthContext, model: ModelSnapshot, *, n: int, size: int,
                             exact: bool, max_tokens: int | None = None, tokens: int | None = None,
                             request_priority: int | None = None, constrained: bool = False) -> None:
    """Step 6, before any render or image work: the key's limits on an estimate (``tokens``, else
    ``limits.estimate(model, size, n, max_tokens)``; 429): added to ``scope.grant`` when the preamble took the
    request and concurrency limits already (``limits.add_tokens``), else taken whole (``limits.acquire``); then the admission pre-check of ``n`` requests of at
    most ``size`` (bytes, or with ``exact`` token ids; 503), counted for the caller's tenant (fair share, tier). Both
    are recorded on ``scope`` as soon as taken (``constrained``: the request asks for an output constraint, which
    weighs more in its tenant's fair share: ``admission.precheck``); ``scope.priority`` becomes the engine priority of the caller's tier,
    its tenant's standing against its fair share at admission, and the request's own ``priority`` (which only orders
    it later within the tier)."""
    if tokens is None:
        tokens = limits.estimate(model, size, n, max_tokens, exact=exact)
    if scope.grant is None:
        scope.grant = await limits.acquire(consumer, ctx, tokens)
    else:
        await limits.add_tokens(consumer, ctx, scope.grant, tokens)
    scope.reservation = await admission.precheck(model, scope.recorder.request_id, n, size, exact=exact, ctx=ctx,
                                                 constrained=constrained)
    scope.priority = engine_priority(ctx.priority_tier, request_priority, scope.reservation.fair_rank)


async def admit_and_start(scope: RequestScope, model: ModelSnapshot, tokenizer: LoadedTokenizer, processed: ProcessedInput, *,
                          stop: str | list[str] | None, include_stop_str_in_output: bool, skip_special_tokens: bool,
                          arrival_time: float) -> GenerationRun:
    """Step 9: the exact reserve (``n`` × real prompt tokens, ``ProcessedInput.prompt_tokens_per_request``; 503),
    then the engine hand-off (503): returns the started run, recorded on ``scope``. The engine requests get ``scope.priority`` (tier, then arrival). A request
    whose client is already gone (a cancellation lost on the way, ``gateway/disconnect.py``) stops here. ``stop``: the
    request's stop strings as its schema types them (validated into a list; one string is one stop)."""
    raise_if_client_gone()
    await admission.reserve(scope.admitted, len(processed.requests), processed.prompt_tokens_per_request)
    for request in processed.requests:
        request.priority = scope.priority
    stops = [stop] if isinstance(stop, str) else stop
    run = scope.run = GenerationRun(model, processed, tokenizer, stop=stops,
                                    include_stop_str_in_output=include_stop_str_in_output,
                                    skip_special_tokens=skip_special_tokens, arrival_time=arrival_time,
                                    reservation=scope.reservation)
    await run.start()
    return run


async def render_chat_input(ctx: AuthContext, model: ModelSnapshot, req: ChatCompletionRequest, *, external_id: str,
                            client_id: str, arrival_time: float) -> tuple[LoadedTokenizer, RenderedChat,
                                                                          ProcessedInput]:
    """Steps 7-8 of a chat request: validate its structured-output constraint (400), load the tokenizer, bound
    the prompt characters, render the messages (with their images) and process the result (with the request's
    output parsing, ``processed.chat_output``, and the ``tool_choice`` constraint). Returns
    ``(tokenizer, rendered, processed)``; ``rendered`` holds the prompt's ids and its images' feature keys
    (``inputs.attach_media``). Raises ``ApiError`` (400 naming the field, 503)."""
    structured = await inputs.structured_constraint(req, ctx)
    tokenizer = await rendering.load_tokenizer(model)
    rendering.check_prompt_chars(model, tokenizer, rendering.message_chars(req.messages), "messages")
    salt = inputs.cache_salt_for(ctx, req.cache_salt)
    rendered = await render_chat_media(model, rendering.chat_render_payload(model, req), cache_salt=salt,
                                       tenant_id=ctx.tenant_id)
    prompt_ids = rendered.prompt_token_ids
    processed = inputs.process(
        req, model, tokenizer, external_id=external_id, prompt_token_ids=prompt_ids,
        prompt_param="messages", client_id=client_id, arrival_time=arrival_time,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None, cache_salt=salt, structured=structured,
        chat_output=inputs.chat_output_spec(req, model, tokenizer, prompt_ids))
    return tokenizer, rendered, processed
