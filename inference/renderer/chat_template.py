"""Chat-template rendering and tokenization, equal token for token to transformers 5.24's
``apply_chat_template`` (docs/ARCHITECTURE.md §4), in a hardened sandbox (see ``sandbox.py``).

Pipeline of ``render_chat`` (sources in brackets):

1. Resolve the template: an explicit ``chat_template`` (a name of one of the tokenizer's named
   templates, else a literal template), else ``"tool_use"`` when tools are given and the tokenizer
   has it, else the default; none -> ``NoChatTemplateError`` [``get_chat_template``].
2. Normalise the messages as vLLM does before calling transformers
   [``vllm/renderers/chat_utils/chat_message.py``]:
   * content ``None``/missing -> ``""``; a list of text parts (``text``/``input_text``/
     ``output_text``/``refusal``) -> the texts joined with ``"\\n"`` (a single part renders exactly
     like the plain string). Templates that loop over ``message.content`` ("openai" content
     format, detected from the template's Jinja AST like vLLM's ``_detect_content_format``) get a
     list of ``{"type": "text", "text": ...}`` parts instead (a string becomes one part); tool
     messages always get a string. Non-text parts -> ``InvalidMessagesError`` (no multimodal here).
   * ``tool_calls``: must be a list of objects of type ``function``; an empty list is dropped;
     ``function.arguments`` given as a JSON string is parsed into a dict; invalid or non-object JSON
     (``"null"`` included) is an ``InvalidMessagesError`` naming the field (vLLM renders ``{}``, issue 16).
   * ``developer`` messages become ``system`` when the template never mentions ``"developer"``.
   * then transformers' own steps: keys whose value is None are dropped
     [``_normalize_chat_messages``], reasoning aliases ``reasoning_content``/``thinking``/
     ``reasoning`` are filled from each other [``_alias_reasoning_fields``].
3. Render with variables ``messages, tools, documents, add_generation_prompt`` plus the special
   tokens map overridden by ``chat_template_kwargs`` [``apply_chat_template``]; with
   ``continue_final_message`` the final message's content is tagged and the output is cut right
   after it [``render_jinja_template``].
4. ``prompt_token_ids = encode(prompt_text, add_special_tokens=add_special_tokens)`` (default
   False: no second BOS on top of the template's).
   When a string of the request holds a control-token string (a special token of the tokenizer), the
   template is rendered a second time with those strings neutralised and only the control tokens of that
   render (the template's markup) become control ids; the rest is encoded as text (``encode_rendered``,
   ``allow_control_tokens=True`` restores the one-string encode).
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypedDict, cast

import jinja2
import jinja2.nodes

from inference.shared.config import SETTINGS

from .errors import (
    InvalidMessagesError,
    InvalidTemplateKwargsError,
    NoChatTemplateError,
    RenderError,
    TemplateLimitError,
    TemplateRenderError,
    TemplateSecurityError,
    TemplateSyntaxError,
)
from .sandbox import ChatTemplateEnvironment, RenderBudget, activate_budget, deactivate_budget
from .tokenizer_cache import LoadedTokenizer, get_tokenizer

DEFAULT_MAX_OUTPUT_CHARS = SETTINGS.render_max_output_chars
DEFAULT_MAX_OPS = SETTINGS.render_max_ops

# Arguments of render_chat that chat_template_kwargs may not override (vLLM rejects
# ``chat_template``/``tokenize`` in chat_template_kwargs; the others would collide).
_RESERVED_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize"}
)
_TEXT_PART_TYPES = {"text", "input_text", "output_text", "refusal"}
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


_template_clock = threading.local()


def reset_template_seconds() -> None:
    """Start counting, for this thread, the seconds spent inside ``render_template`` (a task calls it first)."""
    _template_clock.total = 0.0


def template_seconds() -> float:
    """Seconds this thread has spent inside ``render_template`` since ``reset_template_seconds``; a task whose
    wall-time limit ran out uses it to tell a slow template (the client's input) from a slow worker."""
    return float(getattr(_template_clock, "total", 0.0))


@dataclass
class RenderedPrompt:
    """Result of ``render_chat``: the rendered text and its token ids."""

    prompt_text: str
    prompt_token_ids: list[int]


# --------------------------------------------------------------------------------------------
# Template compilation and content-format detection
# --------------------------------------------------------------------------------------------
_ENV: ChatTemplateEnvironment | None = None


def _env() -> ChatTemplateEnvironment:
    global _ENV
    if _ENV is None:
        _ENV = ChatTemplateEnvironment()
    return _ENV


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """Compile ``source`` in the chat-template sandbox (cached). Raises ``TemplateSyntaxError``."""
    try:
        return _env().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateSyntaxError(f"chat template is not valid Jinja2: {exc.message} (line {exc.lineno})") from exc
    except RenderError:
        raise
    except Exception as exc:  # any compile failure is the template's fault
        raise TemplateSyntaxError(f"chat template cannot be compiled: {exc}") from exc


def _is_content_access(node: jinja2.nodes.Node, content_vars: set[str]) -> bool:
    """``x.content`` / ``x['content']`` / a variable assigned from one of them, through filters."""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getattr) and node.attr == "content":
        return True
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content":
        return True
    return isinstance(node, jinja2.nodes.Name) and node.name in content_vars


@lru_cache(maxsize=64)
def detect_content_format(source: str) -> str:
    """``"openai"`` if the template loops over a message's ``content`` (directly or through a
    variable assigned from it), else ``"string"``; unparseable -> ``"string"``.

    Follows vLLM's ``_detect_content_format`` (``vllm/renderers/hf.py``), simplified: any
    ``x.content``/``x['content']`` is accepted, not only the loop variable of ``messages``.
    """
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(
            source.replace("{% generation %}", "").replace("{% endgeneration %}", "")
        )
    except Exception:  # noqa: BLE001
        return "string"
    content_vars: set[str] = set()
    for assign in ast.find_all(jinja2.nodes.Assign):
        if isinstance(assign.target, jinja2.nodes.Name) and _is_content_access(assign.node, set()):
            content_vars.add(assign.target.name)
    for loop in ast.find_all(jinja2.nodes.For):
        if _is_content_access(loop.iter, content_vars):
            return "openai"
    return "string"


def resolve_template(tok: LoadedTokenizer, chat_template: str | None, tools: Any) -> str:
    """The template source to use (see module docstring, step 1). Raises ``NoChatTemplateError``."""
    if chat_template is not None:
        if chat_template in tok.chat_templates:
            return tok.chat_templates[chat_template]
        return chat_template
    if tools is not None and "tool_use" in tok.chat_templates:
        return tok.chat_templates["tool_use"]
    if tok.chat_template is not None:
        return tok.chat_template
    if tok.chat_templates:
        raise NoChatTemplateError(
            "this model has several chat templates and none is the default; available: "
            f"{sorted(tok.chat_templates)}",
            param="chat_template",
        )
    raise NoChatTemplateError(
        "this model has no chat template (tokenizer_config.json has no chat_template and there is no "
        "chat_template.jinja); since transformers v4.44 there is no default template, so a chat "
        "template must be configured for the model. Send a plain prompt instead ('prompt' on /v1/completions or "
        "/tokenize; 'input' on /v1/embeddings for an embedding model).",
        param="messages",
    )


# --------------------------------------------------------------------------------------------
# Message normalisation
# --------------------------------------------------------------------------------------------
def _plain(value: Any, where: str) -> Any:
    """Deep copy restricted to JSON types (what a template may see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, str) else str.__str__(k): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump(), where)
    raise InvalidMessagesError(f"{where} contains a value of unsupported type {type(value).__name__}", param=where)


def _text_of_parts(parts: list[Any], idx: int) -> list[str | None]:
    """Texts of the parts; ``None`` marks a ``{"type": "image"}`` slot (multimodal prompts)."""
    texts: list[str | None] = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise InvalidMessagesError(f"messages[{idx}].content[{j}] must be an object")
        ptype = part.get("type", "text")
        if ptype == "image":  # an image slot left by inference.renderer.multimodal.extract_images
            texts.append(None)
            continue
        if ptype in _TEXT_PART_TYPES:
            text = part.get("refusal") if ptype == "refusal" and "text" not in part else part.get("text")
            if not isinstance(text, str):
                raise InvalidMessagesError(f"messages[{idx}].content[{j}].text must be a string")
            texts.append(text)
        else:
            raise InvalidMessagesError(
                f"messages[{idx}].content[{j}] has unsupported type {ptype!r}; this server renders text "
                f"parts only ({sorted(_TEXT_PART_TYPES)})"
            )
    return texts


def _parse_arguments(args: Any, param: str) -> Any:
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise InvalidMessagesError(f"{param} must be a JSON object encoded as a string", param=param)
        return parsed
    return args


def normalize_messages(messages: Any, *, content_format: str, template_has_developer: bool) -> list[dict[str, Any]]:
    """Normalise an OpenAI-style conversation for a template (module docstring, step 2).

    Returns fresh dicts (the input is not modified). Raises ``InvalidMessagesError``.
    """
    if not isinstance(messages, (list, tuple)):
        raise InvalidMessagesError("messages must be a list of message objects")
    if len(messages) == 0:
        raise InvalidMessagesError("messages must contain at least one message")
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(messages):
        msg = _plain(raw, "messages")
        if not isinstance(msg, dict):
            raise InvalidMessagesError(f"messages[{i}] must be an object with a 'role'")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidMessagesError(f"messages[{i}].role must be a non-empty string")
        if role == "developer" and not template_has_developer:
            msg["role"] = role = "system"
        content = msg.get("content")
        if content is None:
            texts: list[str | None] | None = []
        elif isinstance(content, str):
            texts = None
        elif isinstance(content, list):
            texts = _text_of_parts(content, i)
        else:
            raise InvalidMessagesError(f"messages[{i}].content must be a string, a list of parts or null")
        if content_format == "openai" and role != "tool":
            parts = [content] if texts is None else texts
            msg["content"] = [{"type": "image"} if t is None else {"type": "text", "text": t} for t in parts]
        else:
            if texts is not None and None in texts:
                raise InvalidMessagesError(f"messages[{i}] has an image part but this model's chat template "
                                           "does not iterate over content parts")
            msg["content"] = content if texts is None else "\n".join(cast("list[str]", texts))  # no image slot (above)

        if "tool_calls" in msg:
            calls = msg["tool_calls"]
            if calls is None or calls == []:
                msg.pop("tool_calls")
            elif not isinstance(calls, list):
                raise InvalidMessagesError(f"messages[{i}].tool_calls must be a list")
            else:
                for j, call in enumerate(calls):
                    if not isinstance(call, dict) or call.get("type", "function") != "function":
                        raise InvalidMessagesError(f"messages[{i}].tool_calls[{j}] must be an object of type 'function'")
                    fn = call.get("function")
                    if not isinstance(fn, dict):
                        raise InvalidMessagesError(f"messages[{i}].tool_calls[{j}].function must be an object")
                    if "arguments" in fn:
                        fn["arguments"] = _parse_arguments(fn["arguments"],
                                                           f"messages[{i}].tool_calls[{j}].function.arguments")
        # transformers: drop None-valued keys, then alias the reasoning fields.
        msg = {k: v for k, v in msg.items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------
def _input_size(*values: Any) -> int:
    total = 0
    stack = list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
            stack.extend(k for k in v if isinstance(k, str))
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total


def render_template(
    source: str,
    variables: dict[str, Any],
    *,
    max_output_chars: int,
    max_ops: int,
) -> str:
    """Render a chat template in the sandbox with the given variables.

    Raises ``TemplateSyntaxError``, ``TemplateRenderError`` (message = the template's own for
    ``raise_exception``), ``TemplateSecurityError``, ``TemplateLimitError`` (output over
    ``max_output_chars`` characters, or more than ``max_ops`` loop iterations/calls).
    """
    started = time.monotonic()
    template = compile_template(source)
    budget = RenderBudget(max_ops=max_ops, max_chars=max_output_chars)
    token = activate_budget(budget)
    chunks: list[str] = []
    size = 0
    try:
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > max_output_chars:
                raise TemplateLimitError(
                    f"rendered chat prompt exceeds {max_output_chars} characters", param="messages"
                )
            chunks.append(chunk)
    except RenderError:
        raise
    except jinja2.exceptions.SecurityError as exc:
        raise TemplateSecurityError(f"chat template security violation: {exc}") from exc
    except jinja2.exceptions.TemplateError as exc:
        # raise_exception(...) raises a bare TemplateError carrying the template's message.
        raise TemplateRenderError(exc.message or str(exc) or type(exc).__name__) from exc
    except RecursionError as exc:
        raise TemplateLimitError("chat template recursed too deeply") from exc
    except OverflowError as exc:  # Jinja's sandboxed range() over MAX_RANGE, huge numbers
        raise TemplateLimitError(f"chat template exceeded a limit: {exc}") from exc
    except MemoryError as exc:
        raise TemplateLimitError("chat template ran out of memory") from exc
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
        raise TemplateRenderError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
    finally:
        deactivate_budget(token)
        _template_clock.total = template_seconds() + (time.monotonic() - started)
    return "".join(chunks)


def warm_up(tokenizer_dir: str, chat_template: str | None = None) -> None:
    """Load ``tokenizer_dir``'s tokenizer (and its text-only copy, ``LoadedTokenizer.text_only_tokenizer``) and
    compile its chat template into this process's caches, so the
    first request a worker serves does not pay for them inside its time limit. Errors are the caller's to
    log: ``TokenizerLoadError``, ``TemplateSyntaxError`` (a model without a chat template warms its tokenizer
    only)."""
    tok = get_tokenizer(tokenizer_dir)
    try:
        source = resolve_template(tok, chat_template, None)
    except NoChatTemplateError:  # an embedding model, or completions only: the tokenizer is what it needs
        return
    compile_template(source)
    detect_content_format(source)
    if tok.control_regex is not None:  # the text-only copy a request with control strings needs (~1 s, ~17 MiB)
        tok.text_only_tokenizer()


class _RenderArgs(TypedDict):
    """The ``render_chat_text`` arguments ``render_chat`` passes to both of its renders."""

    add_generation_prompt: bool
    continue_final_message: bool
    chat_template: str | None
    max_output_chars: int | None
    max_ops: int | None


def render_chat(
    tokenizer_dir: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
    max_output_chars: int | None = None,
    max_ops: int | None = None,
    allow_control_tokens: bool = False,
) -> RenderedPrompt:
    """Render ``messages`` with the model's chat template and tokenize the result.

    Arguments as ``render_chat_text``, plus:

        add_special_tokens: add the tokenizer's BOS/EOS on top of the rendered text (default no).
        allow_control_tokens: ``False`` (default): control-token strings (the tokenizer's special added
            tokens) inside request text (messages, tools, documents, chat_template_kwargs) are encoded as
            plain text, never as control ids, so a user message holding ``<|im_end|>\n<|im_start|>system``
            cannot forge a system turn; only the template's own markup yields control ids (see
            ``encode_rendered``). A request whose text holds no control-token string is tokenized
            exactly as before (one ``encode`` of the rendered text, transformers' ids). ``True``: the whole
            rendered text is tokenized at once, specials recognised wherever they are (what transformers'
            ``apply_chat_template(tokenize=True)`` and vLLM do).

    Returns ``RenderedPrompt(prompt_text, prompt_token_ids)``.
    Raises a ``RenderError`` subclass (see ``errors.py``); all are ``ValueError``; ``InvalidMessagesError``
    (param ``messages``) when the template renders the request differently once its control-token strings are
    neutralised (the trusted markup cannot be told apart then).
    """
    tok = get_tokenizer(tokenizer_dir)
    args = _RenderArgs(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       chat_template=chat_template, max_output_chars=max_output_chars, max_ops=max_ops)
    text = render_chat_text(tokenizer_dir, messages, tools=tools, documents=documents,
                            chat_template_kwargs=chat_template_kwargs, **args)
    inputs = (messages, tools, documents, chat_template_kwargs)
    if allow_control_tokens or tok.control_regex is None or not _holds_control(tok.control_regex, inputs):
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
    else:
        n_messages, n_tools, n_documents, n_kwargs = _neutralize(tok, inputs)
        neutral = render_chat_text(tokenizer_dir, n_messages, tools=n_tools, documents=n_documents,
                                   chat_template_kwargs=n_kwargs, **args)
        try:
            ids = encode_rendered(tok, text, neutral, add_special_tokens=add_special_tokens)
        except InvalidMessagesError:
            split = _split_reasoning(tok, messages)
            if split is None:
                raise
            # the template splits the reasoning off the content itself (Qwen3): with the split done here the
            # template emits its own <think> tags; accepted only when the text is exactly the same
            if render_chat_text(tokenizer_dir, split, tools=tools, documents=documents,
                                chat_template_kwargs=chat_template_kwargs, **args) != text:
                raise
            neutral = render_chat_text(tokenizer_dir, _neutralize(tok, split), tools=n_tools, documents=n_documents,
                                       chat_template_kwargs=n_kwargs, **args)
            ids = encode_rendered(tok, text, neutral, add_special_tokens=add_special_tokens)
    return RenderedPrompt(prompt_text=text, prompt_token_ids=ids)


_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def _split_reasoning(tok: LoadedTokenizer, messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """``messages`` with the reasoning of each assistant message whose string ``content`` holds ``</think>`` and
    which has no reasoning field moved to ``reasoning_content``, split as Qwen3's template splits it
    (``reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n')``,
    ``content = content.split('</think>')[-1].lstrip('\\n')``); ``None`` when the tokenizer has no
    ``</think>`` control token or no message changes. The caller keeps the result only when the template renders
    it to the same text (DECISIONS: reasoning tags in assistant content)."""
    if _THINK_CLOSE not in tok.control_tokens:
        return None
    out: list[dict[str, Any]] = []
    changed = False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if (isinstance(m, dict) and m.get("role") == "assistant" and isinstance(content, str)
                and _THINK_CLOSE in content and all(m.get(f) is None for f in _REASONING_FIELDS)):
            reasoning = content.split(_THINK_CLOSE)[0].rstrip("\n").split(_THINK_OPEN)[-1].lstrip("\n")
            m = {**m, "content": content.split(_THINK_CLOSE)[-1].lstrip("\n"), "reasoning_content": reasoning}
            changed = True
        out.append(m)
    return out if changed else None


# A neutral stand-in for one character of a control-token string in request text: a private-use character
# (not whitespace, no case, kept as is by ``tojson``, in no tokenizer's special tokens).
_NEUTRAL_CHAR = "\ue000"


def _holds_control(pattern: re.Pattern[str], value: Any) -> bool:
    """True when any string in ``value`` (nested dicts/lists/tuples, keys included) contains a match of
    ``pattern``."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if pattern.search(v):
                return True
        elif isinstance(v, dict):
            stack.extend(v.values())
            stack.extend(k for k in v if isinstance(k, str))
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif callable(getattr(v, "model_dump", None)):
            stack.append(v.model_dump())
    return False


def _neutralize(tok: LoadedTokenizer, value: Any) -> Any:
    """Copy of ``value`` with every control-token string inside its strings (keys included) replaced by as
    many ``_NEUTRAL_CHAR`` characters (same length, so the template's output keeps its layout)."""
    pattern = tok.control_regex
    assert pattern is not None  # called only for a tokenizer with control tokens (``render_chat``)
    if isinstance(value, str):
        return pattern.sub(lambda m: _NEUTRAL_CHAR * len(m.group()), value)
    if isinstance(value, dict):
        return {_neutralize(tok, k): _neutralize(tok, v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_neutralize(tok, v) for v in value)
    if isinstance(value, list):
        return [_neutralize(tok, v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _neutralize(tok, value.model_dump())
    return value


def encode_rendered(tok: LoadedTokenizer, text: str, neutral: str, add_special_tokens: bool = False) -> list[int]:
    """Ids of the rendered ``text`` in which only the template's own control tokens are control ids.

    ``neutral`` is the same template rendered with every control-token string inside the request text replaced
    by same-length neutral characters: the control-token occurrences found in it are the template's markup
    (the trusted ones). ``text`` is split at those positions; the trusted occurrences get their ids and the
    text between them is encoded with special-token matching off (``tokenizers``' ``encode_special_tokens``,
    transformers' ``split_special_tokens=True``), see ``LoadedTokenizer.encode_with_trusted``.

    Raises ``InvalidMessagesError`` (param ``messages``) when the two renders differ in length or a trusted
    occurrence is not in ``text`` (the template branches on the control-token strings, so its markup cannot be
    located): refused rather than guessed.
    """
    assert tok.control_regex is not None  # called only for a tokenizer with control tokens (``render_chat``)
    trusted = [(m.start(), m.end()) for m in tok.control_regex.finditer(neutral)]
    if len(neutral) != len(text) or any(text[a:b] != neutral[a:b] for a, b in trusted):
        raise InvalidMessagesError(
            "the request text contains control-token strings (special tokens of this model's tokenizer) that "
            "change how its chat template lays out the conversation; remove them", param="messages")
    return tok.encode_with_trusted(text, trusted, add_special_tokens=add_special_tokens)


def _checked_render_args(
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: Any,
    documents: Any,
    chat_template_kwargs: Any,
) -> dict[str, Any]:
    """The request's ``chat_template_kwargs`` as a fresh dict once the render options are consistent.

    Raises ``InvalidTemplateKwargsError`` when both ``continue_final_message`` and ``add_generation_prompt`` are
    set, ``tools``/``documents`` are not lists of objects, ``chat_template_kwargs`` is not an object or sets a
    reserved (``_RESERVED_KWARGS``) or non-string name."""
    if continue_final_message and add_generation_prompt:
        raise InvalidTemplateKwargsError(
            "continue_final_message and add_generation_prompt cannot both be true", param="continue_final_message"
        )
    if tools is not None and not isinstance(tools, list):
        raise InvalidTemplateKwargsError("tools must be a list of objects", param="tools")
    if tools is not None and any(not isinstance(t, dict) for t in tools):
        raise InvalidTemplateKwargsError("tools must be a list of objects", param="tools")
    if documents is not None and (
        not isinstance(documents, list) or any(not isinstance(d, dict) for d in documents)
    ):
        raise InvalidTemplateKwargsError("documents must be a list of objects", param="documents")
    kwargs = dict(chat_template_kwargs or {})
    if not isinstance(chat_template_kwargs or {}, dict):
        raise InvalidTemplateKwargsError("chat_template_kwargs must be an object")
    bad = sorted(k for k in kwargs if k in _RESERVED_KWARGS or not isinstance(k, str))
    if bad:
        raise InvalidTemplateKwargsError(f"chat_template_kwargs may not set {bad}")
    return kwargs


def _tag_final_message(chat: list[dict[str, Any]], source: str) -> str:
    """For ``continue_final_message``: append ``_CONTINUE_TAG`` to the text of the last message of ``chat`` (its
    string content, or its last part holding ``text``), in place, and return that text as it was.

    Raises ``InvalidMessagesError`` (param ``continue_final_message``) when the template ``source`` never reads
    message content or the final message has no text to continue."""
    last = chat[-1]
    if "content" not in source:
        raise InvalidMessagesError(
            "continue_final_message is set but the chat template does not read message content",
            param="continue_final_message",
        )
    content = last.get("content")
    if isinstance(content, list):
        for part in reversed(content):
            if "text" in part:
                final_text: str = part["text"]
                part["text"] = part["text"] + _CONTINUE_TAG
                return final_text
        raise InvalidMessagesError(
            "continue_final_message is set but the final message has no text to continue",
            param="continue_final_message",
        )
    if isinstance(content, str):
        last["content"] = content + _CONTINUE_TAG
        return content
    raise InvalidMessagesError(
        "continue_final_message is set but the final message has no content", param="continue_final_message"
    )


def _cut_at_final_message(text: str, final_text: str) -> str:
    """The rendered ``text`` cut at the last ``_CONTINUE_TAG`` (rendered after the final message's ``final_text``),
    so the model continues that message; where the template trimmed the tag's trailing space, the whitespace before
    the tag is cut too.

    Raises ``TemplateRenderError`` (param ``continue_final_message``) when the template dropped the final text or
    the tag."""
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in text or tag not in text:
        raise TemplateRenderError(
            "continue_final_message is set but the final message does not appear in the rendered "
            "chat; the chat template removes part of it",
            param="continue_final_message",
        )
    loc = text.rindex(tag)
    if text[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:loc]
    return text[:loc].rstrip()


def render_chat_text(
    tokenizer_dir: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    max_output_chars: int | None = None,
    max_ops: int | None = None,
) -> str:
    """Render ``messages`` with the model's chat template (the text ``render_chat`` tokenizes).

    Args:
        tokenizer_dir: directory with tokenizer.json / tokenizer_config.json (cached per process).
        messages: OpenAI-style messages (dicts with ``role`` and ``content`` and optionally
            ``tool_calls``, ``tool_call_id``, ``name``, ``reasoning_content``...).
        add_generation_prompt / continue_final_message: as transformers; both true -> error.
        tools / documents: lists of dicts passed to the template (``None`` = absent).
        chat_template: a template name (``"tool_use"``) or a literal template; ``None`` = the model's.
        chat_template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}``); they
            override special-token variables; reserved names are refused.
        max_output_chars: cap on the rendered text; default ``RENDER_MAX_OUTPUT_CHARS`` (1 MiB)
            plus 4x the characters of the inputs (large conversations are legitimate, template
            amplification is not).
        max_ops: operation budget (loop iterations + calls + filters + intercepted operators);
            default ``RENDER_MAX_OPS`` (200,000) plus 100 per input message/tool/document plus 1
            per input character. Real templates use 3-8 per message (Qwen3, Gemma 3, Llama 3.1,
            DeepSeek-V3 measured on 2001 messages); an empty nested ``range(99999)`` loop stops
            after ~0.2 s.

    Returns the rendered text.
    Raises a ``RenderError`` subclass (see ``errors.py``); all are ``ValueError``.
    """
    tok = get_tokenizer(tokenizer_dir)
    kwargs = _checked_render_args(add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message, tools=tools, documents=documents,
                                  chat_template_kwargs=chat_template_kwargs)

    source = resolve_template(tok, chat_template, tools)
    content_format = detect_content_format(source)
    has_developer = "'developer'" in source or '"developer"' in source
    chat = normalize_messages(messages, content_format=content_format, template_has_developer=has_developer)
    final_text = _tag_final_message(chat, source) if continue_final_message else None

    variables: dict[str, Any] = {**tok.special_tokens_map, **_plain(kwargs, "chat_template_kwargs")}
    variables.update(
        messages=chat,
        tools=_plain(tools, "tools"),
        documents=_plain(documents, "documents"),
        add_generation_prompt=bool(add_generation_prompt),
    )
    n_items = len(chat) + len(tools or []) + len(documents or [])
    input_chars = _input_size(chat, tools, documents, kwargs)
    if max_output_chars is None:
        max_output_chars = DEFAULT_MAX_OUTPUT_CHARS + 4 * input_chars
    if max_ops is None:
        max_ops = DEFAULT_MAX_OPS + 100 * n_items + input_chars
    text = render_template(source, variables, max_output_chars=max_output_chars, max_ops=max_ops)
    return text if final_text is None else _cut_at_final_message(text, final_text)


def tokenize_prompt(tokenizer_dir: str, prompt: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a plain prompt (``/v1/completions``, ``/tokenize``); BOS added by default like
    transformers, except when the prompt text already starts with the BOS string (one BOS, never two). Raises ``RenderError`` (param ``prompt``) if ``prompt`` is not a string."""
    if not isinstance(prompt, str):
        raise RenderError("prompt must be a string", param="prompt")
    tok = get_tokenizer(tokenizer_dir)
    ids = tok.encode(prompt, add_special_tokens=add_special_tokens)
    # A prompt that already starts with the BOS string (e.g. a client-rendered chat template) must not gain
    # a second BOS (conformance C01; vLLM's completions path doubled it).
    bos, bos_id = tok.bos_token, tok.bos_token_id
    if (add_special_tokens and bos and bos_id is not None and prompt.startswith(bos)
            and len(ids) >= 2 and ids[0] == bos_id and ids[1] == bos_id):
        del ids[0]
    return ids


def detokenize(tokenizer_dir: str, ids: list[int], skip_special_tokens: bool = False) -> str:
    """Text of ``ids`` (``/detokenize``). Raises ``TokenIdError`` naming the first bad id."""
    if not isinstance(ids, (list, tuple)):
        raise RenderError("tokens must be a list of integers", param="tokens")
    return get_tokenizer(tokenizer_dir).decode(list(ids), skip_special_tokens=skip_special_tokens)
