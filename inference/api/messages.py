"""The Messages API adapter's pure conversions (Django-free; the route is ``gateway/endpoints/messages.py``).

In: a validated ``MessagesRequest`` / ``CountTokensRequest`` (``inference.protocol.anthropic``) becomes the one
internal request, ``ChatCompletionRequest`` (``chat_request``), validated by the same schema as a chat body:

* ``system`` (a string or text blocks, joined with a newline) is the first message, role ``system``;
* a user turn's ``tool_result`` blocks become ``tool`` messages (``tool_call_id`` = ``tool_use_id``; the text of an
  ``is_error`` result starts with ``Error: ``), placed before the turn's other blocks; its ``text`` and ``image``
  blocks (base64 → a ``data:`` URL, ``url`` as it is) become the user message's parts (the chat route's image path);
* an assistant turn's ``text`` blocks are its content, ``tool_use`` blocks its ``tool_calls`` (``input`` as the
  arguments' JSON), ``thinking`` blocks its ``reasoning_content`` once their signature verifies (``signature_ok``;
  else a 400 naming the block), ``redacted_thinking`` is accepted and left out (the platform never emits one);
* a final assistant turn is a prefill: ``continue_final_message``;
* ``tools[].input_schema`` → ``function.parameters``; ``tool_choice`` ``auto``/``any``/``tool``/``none`` →
  ``auto``/``required``/the named function/``none`` (the chat route's forced-tool constraint),
  ``disable_parallel_tool_use`` → ``parallel_tool_calls: false``; ``stop_sequences`` → ``stop``;
  ``metadata.user_id`` → ``user``; ``thinking`` → ``chat_template_kwargs.enable_thinking`` (off unless enabled, as
  Anthropic's default), its ``budget_tokens`` enforced by the route (``ThinkingBudget``).

Out: one choice's parsed output (``inference.api.chat_output.ChatOutputParser``) as content blocks (``message_blocks``)
or, streamed, as the events of ``StreamBlocks``; ``stop_reason`` and ``usage`` in Anthropic's terms. A thinking
block's ``signature`` is ``thinking_signature``: HMAC-SHA256 over the tenant, the model and the text.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any, Callable

from inference.api.chat_output import ChatDelta, ChatOutputParser, ToolCallOut
from inference.protocol.anthropic import (
    CountTokensRequest,
    ImageBlock,
    MessageParam,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ThinkingEnabled,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    anthropic_param,
)
from inference.protocol.engine import FINISH_LENGTH
from inference.protocol.openai import ChatCompletionRequest, RequestValidationError, validate_request
from inference.shared.markers import TextBuffer

SignatureCheck = Callable[[str, str], bool]
"""``signature_ok(thinking_text, signature)``: the route's verifier of a replayed thinking block."""
Event = tuple[str, dict[str, Any]]
"""A stream event: its ``event:`` name and its JSON object."""

END_TURN, MAX_TOKENS, STOP_SEQUENCE, TOOL_USE = "end_turn", "max_tokens", "stop_sequence", "tool_use"


# ------------------------------------------------------------------------------------------------ signatures
def thinking_signature(key: bytes, tenant: str, model: str, text: str) -> str:
    """The ``signature`` of a thinking block: base64 of HMAC-SHA256 under ``key`` over the tenant, the served model and
    the thinking text (each length-prefixed, so no two triples share an input)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in (tenant, model, text):
        data = part.encode("utf-8", "surrogatepass")
        mac.update(len(data).to_bytes(8, "big") + data)
    return base64.b64encode(mac.digest()).decode()


def signature_matches(key: bytes, tenant: str, model: str, text: str, signature: str) -> bool:
    """True when ``signature`` is ``thinking_signature(key, tenant, model, text)`` (compared in constant time)."""
    return hmac.compare_digest(thinking_signature(key, tenant, model, text).encode(),
                               signature.encode("utf-8", "surrogatepass"))


# ---------------------------------------------------------------------------------------------------- inbound
def _image_part(block: ImageBlock) -> dict[str, Any]:
    source = block.source
    url = source.url if source.type == "url" else f"data:{source.media_type};base64,{source.data}"
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_message(block: ToolResultBlock, where: str) -> dict[str, Any]:
    content = block.content
    if isinstance(content, list):
        if any(not isinstance(b, TextBlock) for b in content):
            raise RequestValidationError(f"{where}.content: images inside a tool_result are not supported here; "
                                         "send the image in a user text turn", f"{where}.content")
        text = "\n".join(b.text for b in content if isinstance(b, TextBlock))
    else:
        text = content or ""
    if block.is_error:
        text = f"Error: {text}" if text else "Error"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _user_turn(i: int, blocks: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append(_image_part(block))
        elif isinstance(block, ToolResultBlock):
            out.append(_tool_message(block, f"messages.{i}.content.{j}"))
        else:
            raise RequestValidationError(f"messages.{i}.content.{j}: a {block.type} block belongs to an assistant "
                                         "turn, not a user turn", f"messages.{i}.content.{j}")
    if parts or not out:
        text_only = all(p["type"] == "text" for p in parts)
        out.append({"role": "user", "content": "\n".join(p["text"] for p in parts) if text_only else parts})
    return out


def _assistant_turn(i: int, blocks: list[Any], signature_ok: SignatureCheck) -> dict[str, Any]:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            if not signature_ok(block.thinking, block.signature):
                raise RequestValidationError(
                    f"{where}.signature: the thinking block's signature does not verify (it was altered, or issued "
                    "for another model or tenant); send thinking blocks back exactly as they were returned",
                    f"{where}.signature")
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif not isinstance(block, RedactedThinkingBlock):
            raise RequestValidationError(f"{where}: a {block.type} block belongs to a user turn, not an assistant "
                                         "turn", where)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(system: str | list[TextBlock] | None, turns: list[MessageParam],
              signature_ok: SignatureCheck) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system:
        text = system if isinstance(system, str) else "\n".join(b.text for b in system)
        out.append({"role": "system", "content": text})
    for i, turn in enumerate(turns):
        blocks: list[Any] = [TextBlock(type="text", text=turn.content)] if isinstance(turn.content, str) \
            else list(turn.content)
        if turn.role == "user":
            out.extend(_user_turn(i, blocks))
        else:
            out.append(_assistant_turn(i, blocks, signature_ok))
    return out


def _tool_fields(req: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    if not req.tools:
        return {}
    fields: dict[str, Any] = {"tools": [{"type": "function", "function": {
        "name": t.name, **({"description": t.description} if t.description is not None else {}),
        "parameters": t.input_schema}} for t in req.tools]}
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceTool):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice is not None and not isinstance(choice, ToolChoiceNone) and choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def chat_request(req: MessagesRequest | CountTokensRequest, signature_ok: SignatureCheck) -> ChatCompletionRequest:
    """The internal request of ``req`` (module docstring), validated as a chat body is. Raises
    ``RequestValidationError`` naming the Messages field (``anthropic_param``)."""
    prefill = req.messages[-1].role == "assistant"
    data: dict[str, Any] = {
        "model": req.model, "messages": _messages(req.system, req.messages, signature_ok),
        "chat_template_kwargs": {"enable_thinking": isinstance(req.thinking, ThinkingEnabled)},
        "add_generation_prompt": not prefill, "continue_final_message": prefill, **_tool_fields(req)}
    if isinstance(req, MessagesRequest):
        data.update({"max_tokens": req.max_tokens, "stop": req.stop_sequences, "temperature": req.temperature,
                     "top_p": req.top_p, "top_k": req.top_k,
                     "user": req.metadata.user_id if req.metadata is not None else None})
    try:
        internal: ChatCompletionRequest = validate_request(ChatCompletionRequest, data)
    except RequestValidationError as exc:
        param = anthropic_param(exc.param)
        raise RequestValidationError(f"{param}: {exc.message}" if param else exc.message, param) from None
    return internal


# --------------------------------------------------------------------------------------------------- outbound
def tool_use_block(call: ToolCallOut) -> dict[str, Any]:
    """A call as a ``tool_use`` block: ``id`` ``toolu_<hex>``, ``name``, ``input`` (the arguments' JSON object)."""
    try:
        arguments = json.loads(call.call.arguments)
    except ValueError:
        arguments = None
    return {"type": "tool_use", "id": "toolu_" + call.id.rsplit("-", 1)[-1], "name": call.call.name,
            "input": arguments if isinstance(arguments, dict) else {}}


def message_blocks(parser: ChatOutputParser, sign: Callable[[str], str]) -> list[dict[str, Any]]:
    """A finished choice's ``content``: its thinking block (signed by ``sign``) when it reasoned, its text when it
    wrote any, then one ``tool_use`` block per call."""
    blocks: list[dict[str, Any]] = []
    reasoning = parser.reasoning_text if parser.reasoning is not None else ""
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": sign(reasoning)})
    content = parser.content_text
    if content:
        blocks.append({"type": "text", "text": content})
    blocks.extend(tool_use_block(c) for c in parser.calls)
    return blocks


def stop_reason(engine_reason: str | None, matched: int | str | None, made_calls: bool,
                over_budget: bool) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)``: ``max_tokens`` when the output or the thinking budget ran out, ``tool_use``
    when it made calls, ``stop_sequence`` with the sequence when one of the client's matched, else ``end_turn``."""
    if over_budget or engine_reason == FINISH_LENGTH:
        return MAX_TOKENS, None
    if made_calls:
        return TOOL_USE, None
    if isinstance(matched, str):
        return STOP_SEQUENCE, matched
    return END_TURN, None


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """Anthropic's ``usage``: ``input_tokens`` are the prompt tokens the prefix cache did not serve,
    ``cache_read_input_tokens`` those it did (the engine's ``num_cached_tokens``); nothing is written to a cache on
    request (``cache_creation_input_tokens`` 0)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens, "output_tokens": output_tokens}


class ThinkingBudget:
    """``thinking.budget_tokens`` of one choice: every output token before the reasoning ended is a thinking token;
    ``spent(parsed, tokens_so_far)`` is True once the reasoning has used more than ``limit`` tokens without ending
    (the route then stops the choice: ``stop_reason`` ``max_tokens``). ``None``: no budget."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.ended = limit is None
        self.over = False

    def spent(self, parsed: ChatDelta, tokens_so_far: int) -> bool:
        """Account one delta: ``parsed`` (the parser's output for it) and the choice's output tokens so far."""
        if self.ended:
            return False
        if parsed.content or parsed.calls:
            self.ended = True
            return False
        self.over = tokens_so_far > (self.limit or 0)
        return self.over


class StreamBlocks:
    """One choice's content blocks as stream events: ``push`` a parsed delta, ``finish`` at the end. A block opens
    with ``content_block_start`` when output of its kind starts (thinking, text, each tool call) and closes with
    ``content_block_stop`` when another kind starts; a thinking block's ``signature_delta`` (``sign`` of its whole
    text) comes right before its stop. A call is one ``tool_use`` start, one ``input_json_delta`` and its stop."""

    def __init__(self, sign: Callable[[str], str]):
        self._sign = sign
        self._index = -1
        self._open: str | None = None
        self._thinking = TextBuffer()

    def push(self, parsed: ChatDelta) -> list[Event]:
        """The events of one parsed delta (empty: nothing to send)."""
        events: list[Event] = []
        if parsed.reasoning:
            if self._open != "thinking":
                events += self._begin("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._thinking.append(parsed.reasoning)
            events.append(self._delta({"type": "thinking_delta", "thinking": parsed.reasoning}))
        if parsed.content:
            if self._open != "text":
                events += self._begin("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": parsed.content}))
        for call in parsed.calls:
            block = tool_use_block(call)
            events += self._begin("tool_use", {**block, "input": {}})
            events.append(self._delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"])}))
        return events

    def finish(self) -> list[Event]:
        """The events that close the open block."""
        return self._close()

    def _delta(self, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}

    def _begin(self, kind: str, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self._index += 1
        self._open = kind
        events.append(("content_block_start", {"type": "content_block_start", "index": self._index,
                                               "content_block": block}))
        return events

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        events: list[Event] = []
        if self._open == "thinking":
            text, self._thinking = self._thinking.text(), TextBuffer()
            events.append(self._delta({"type": "signature_delta", "signature": self._sign(text)}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        self._open = None
        return events


def sse(event: Event) -> bytes:
    """One event as SSE bytes: ``event: <name>`` and ``data: <json>``."""
    name, data = event
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
