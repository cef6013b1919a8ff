"""Render wire types: what crosses the Celery ``render`` and ``mm`` queues between api processes and workers.

Importable without Django and without torch. A request is a plain dataclass: ``to_wire()`` is the task's one
argument, a JSON object (``inference.api.celery_publish`` pushes it inside Celery's own message, or ``send_task`` does),
and the worker reads it back with ``from_wire`` (a missing field raises ``PayloadError`` naming it). The worker
answers a result or a ``RenderFailure``; on the wire (the api's reply channel, ``inference.api.render_client``) that is
``{"ok": true, ...}`` or ``{"ok": false, "error": {"type", "message", "param", "code"}}``, and the request's
``parse_reply`` turns it back into the typed value.

=========================== ===== ================================ =====================
task                        queue request                          result
=========================== ===== ================================ =====================
``inference.render_chat``   render ``ChatRenderRequest``            ``RenderedTokens``
``inference.tokenize_prompt`` render ``TokenizeRenderRequest``      ``RenderedTokens``
``inference.detokenize``    render ``DetokenizeRenderRequest``      ``RenderedText``
``inference.mm_preprocess`` mm    ``ImagesRequest``                 ``PreprocessedImages``
=========================== ===== ================================ =====================

A failure's ``code`` is the public error code (``inference.protocol.errors.ErrorCode``) the worker assigns from its
error class (``failure_code``); the api maps codes to HTTP statuses in ``gateway.pipeline.failures``. A
reply without a code (a worker older than this field) gets the code of its ``type``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from inference.protocol.errors import ErrorCode

RENDER_QUEUE = "render"
MM_QUEUE = "mm"

TASK_RENDER_CHAT = "inference.render_chat"
TASK_TOKENIZE_PROMPT = "inference.tokenize_prompt"
TASK_DETOKENIZE = "inference.detokenize"
TASK_MM_PREPROCESS = "inference.mm_preprocess"

# a worker's error class -> the public code of its failure (anything else: ``invalid_prompt``)
FAILURE_CODES: dict[str, ErrorCode] = {
    "ContextLengthError": ErrorCode.CONTEXT_LENGTH_EXCEEDED,
    "TemplateTimeoutError": ErrorCode.TEMPLATE_TIMEOUT,
    "NoChatTemplateError": ErrorCode.NO_CHAT_TEMPLATE,
    "TemplateSecurityError": ErrorCode.TEMPLATE_SECURITY,
    "TemplateLimitError": ErrorCode.TEMPLATE_LIMIT,
    "RenderOverloadedError": ErrorCode.RENDER_UNAVAILABLE,
    "InternalError": ErrorCode.RENDER_INTERNAL_ERROR,
    "ImageError": ErrorCode.INVALID_IMAGE,
    "ImageTimeoutError": ErrorCode.IMAGE_TIMEOUT,
}

Wire = dict[str, Any]
"""A task argument or reply as JSON values (what orjson or ``json`` reads and writes)."""


class PayloadError(ValueError):
    """A task argument that is not the request it should be (a field missing); ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message = message
        self.param = param


def failure_code(error_type: str) -> ErrorCode:
    """The public error code of a worker error class named ``error_type`` (``FAILURE_CODES``)."""
    return FAILURE_CODES.get(error_type, ErrorCode.INVALID_PROMPT)


def _require(payload: object, key: str) -> Any:
    if not isinstance(payload, dict) or key not in payload:
        raise PayloadError(f"payload is missing {key!r}", key)
    return payload[key]


def _get(payload: object, key: str, default: Any) -> Any:
    return payload.get(key, default) if isinstance(payload, dict) else default


@dataclass
class RenderFailure(Exception):
    """A worker's typed error: ``type`` its error class (a ``RenderError`` subclass, ``ImageError``,
    ``ImageTimeoutError``, ``InternalError``...), ``message`` safe to show the client, ``param`` the request field
    to blame (or ``None``), ``code`` the public error code (``failure_code``). Returned by a worker, raised by the
    api side (``gateway.pipeline.failures`` maps it)."""

    type: str
    message: str
    param: str | None = None
    code: str = ErrorCode.INVALID_PROMPT

    def __str__(self) -> str:
        return f"{self.type}: {self.message}"

    @classmethod
    def of(cls, error_type: str, message: str, param: str | None = None) -> RenderFailure:
        """A failure of class ``error_type`` with that class's code."""
        return cls(error_type, message, param, failure_code(error_type))

    def to_wire(self) -> Wire:
        """``{"ok": False, "error": {"type", "message", "param", "code"}}``."""
        return {"ok": False, "error": {"type": self.type, "message": self.message, "param": self.param,
                                       "code": str(self.code)}}

    @classmethod
    def from_wire(cls, reply: Mapping[str, Any]) -> RenderFailure:
        """Inverse of ``to_wire``; a reply without a code gets its type's (``failure_code``)."""
        error = reply.get("error") or {}
        error_type = str(error.get("type") or "RenderError")
        return cls(error_type, str(error.get("message") or "The request could not be rendered"),
                   error.get("param"), str(error.get("code") or failure_code(error_type)))


@dataclass
class RenderedTokens:
    """The answer of ``render_chat`` and ``tokenize_prompt``: the prompt's token ids, the rendered text when asked
    (``ChatRenderRequest.return_prompt_text``), and the segment cache's tallies of the task (``{"hits", "misses",
    "shared_hits"?}``: segments; ``None`` when it was not used)."""

    prompt_token_ids: list[int]
    prompt_text: str | None = None
    segment_cache: dict[str, int] | None = None

    def to_wire(self) -> Wire:
        """``{"ok": True, "prompt_text"?, "prompt_token_ids", "segment_cache"?}``."""
        out: Wire = {"ok": True}
        if self.prompt_text is not None:
            out["prompt_text"] = self.prompt_text
        out["prompt_token_ids"] = self.prompt_token_ids
        if self.segment_cache:
            out["segment_cache"] = self.segment_cache
        return out

    @classmethod
    def from_wire(cls, reply: Mapping[str, Any]) -> RenderedTokens:
        """Inverse of ``to_wire`` (the ids are not copied)."""
        return cls(reply["prompt_token_ids"], reply.get("prompt_text"), reply.get("segment_cache"))


@dataclass
class RenderedText:
    """The answer of ``detokenize``: the text (on the wire ``prompt``, vLLM's ``/detokenize`` field)."""

    text: str
    segment_cache: dict[str, int] | None = None

    def to_wire(self) -> Wire:
        """``{"ok": True, "prompt", "segment_cache"?}``."""
        out: Wire = {"ok": True, "prompt": self.text}
        if self.segment_cache:
            out["segment_cache"] = self.segment_cache
        return out

    @classmethod
    def from_wire(cls, reply: Mapping[str, Any]) -> RenderedText:
        """Inverse of ``to_wire``."""
        return cls(reply["prompt"], reply.get("segment_cache"))


@dataclass
class ImageFeatures:
    """One image's processed features in the shared feature cache: their ``key``, the image's placeholder
    ``num_tokens``, and whether they were ``cached`` already."""

    key: str
    num_tokens: int
    cached: bool = False

    def to_wire(self) -> Wire:
        """``{"key", "num_tokens", "cached"}``."""
        return {"key": self.key, "num_tokens": self.num_tokens, "cached": self.cached}

    @classmethod
    def from_wire(cls, item: Mapping[str, Any]) -> ImageFeatures:
        """Inverse of ``to_wire``."""
        return cls(str(item["key"]), int(item["num_tokens"]), bool(item.get("cached")))


@dataclass
class PreprocessedImages:
    """The answer of ``mm_preprocess``: one ``ImageFeatures`` per work item, in order. ``segment_cache`` is always
    ``None`` (no tokenizing)."""

    items: list[ImageFeatures]
    segment_cache: dict[str, int] | None = None

    def to_wire(self) -> Wire:
        """``{"ok": True, "items": [...]}``."""
        return {"ok": True, "items": [it.to_wire() for it in self.items]}

    @classmethod
    def from_wire(cls, reply: Mapping[str, Any]) -> PreprocessedImages:
        """Inverse of ``to_wire``."""
        return cls([ImageFeatures.from_wire(it) for it in reply["items"]])


RenderResult = RenderedTokens | RenderedText
"""What a ``render``-queue task answers when it succeeds."""

ResultT = TypeVar("ResultT", RenderedTokens, RenderedText, PreprocessedImages)


class RenderTask(Generic[ResultT]):
    """Base of the task requests: the Celery ``task`` name, its ``queue``, ``to_wire`` (the task argument) and
    ``parse_reply`` (the worker's answer as ``ResultT`` or ``RenderFailure``)."""

    task: ClassVar[str]
    queue: ClassVar[str] = RENDER_QUEUE
    _fields: ClassVar[tuple[str, ...]]

    def to_wire(self) -> Wire:
        """The task argument: every field, shallow (no deep copy of the messages)."""
        return {name: getattr(self, name) for name in self._fields}

    def parse_reply(self, reply: Mapping[str, Any]) -> ResultT | RenderFailure:
        """The worker's reply (``{"ok": ...}``) as this task's result or a ``RenderFailure``."""
        if not reply.get("ok"):
            return RenderFailure.from_wire(reply)
        return self._result(reply)

    def _result(self, reply: Mapping[str, Any]) -> ResultT:
        raise NotImplementedError


@dataclass
class ChatRenderRequest(RenderTask[RenderedTokens]):
    """``inference.render_chat``: render ``messages`` (OpenAI chat messages as JSON) with the chat template of the
    tokenizer in ``tokenizer_dir`` (or ``chat_template``) and tokenize the text
    (``inference.renderer.chat_template.render_chat``, whose arguments the middle fields are).
    ``client_chat_template``: ``chat_template`` came from the client, so the api never renders it in-process
    (routing only; the worker ignores it). ``max_model_len``: with it, text over the worker's character bound is
    refused before rendering (``inference.workers.tasks.check_chars``). ``cache_salt``: scopes the segment cache's keys.
    ``return_prompt_text``: False leaves the rendered text out of the answer (the api reads only the ids)."""

    task: ClassVar[str] = TASK_RENDER_CHAT
    _fields: ClassVar[tuple[str, ...]] = (
        "tokenizer_dir", "messages", "add_generation_prompt", "continue_final_message", "tools", "documents",
        "chat_template", "client_chat_template", "chat_template_kwargs", "add_special_tokens", "allow_control_tokens",
        "max_model_len", "return_prompt_text", "cache_salt")

    tokenizer_dir: str
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    client_chat_template: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    allow_control_tokens: bool = False
    max_model_len: int | None = None
    return_prompt_text: bool = True
    cache_salt: str | None = None

    @classmethod
    def from_wire(cls, payload: object) -> ChatRenderRequest:
        """The request in a task argument; ``tokenizer_dir`` and ``messages`` are required (``PayloadError``),
        the rest default as above."""
        tokenizer_dir, messages = _require(payload, "tokenizer_dir"), _require(payload, "messages")
        data: dict[str, Any] = payload if isinstance(payload, dict) else {}
        return cls(tokenizer_dir, messages, **{k: data[k] for k in cls._fields[2:] if k in data})

    def _result(self, reply: Mapping[str, Any]) -> RenderedTokens:
        return RenderedTokens.from_wire(reply)


@dataclass
class TokenizeRenderRequest(RenderTask[RenderedTokens]):
    """``inference.tokenize_prompt``: the token ids of a plain ``prompt`` (BOS per ``add_special_tokens``);
    ``max_model_len`` and ``cache_salt`` as in ``ChatRenderRequest``."""

    task: ClassVar[str] = TASK_TOKENIZE_PROMPT
    _fields: ClassVar[tuple[str, ...]] = ("tokenizer_dir", "prompt", "add_special_tokens", "max_model_len",
                                          "cache_salt")

    tokenizer_dir: str
    prompt: str
    add_special_tokens: bool = True
    max_model_len: int | None = None
    cache_salt: str | None = None

    @classmethod
    def from_wire(cls, payload: object) -> TokenizeRenderRequest:
        """The request in a task argument; ``tokenizer_dir`` and ``prompt`` are required (``PayloadError``)."""
        return cls(_require(payload, "tokenizer_dir"), _require(payload, "prompt"),
                   bool(_get(payload, "add_special_tokens", True)), _get(payload, "max_model_len", None),
                   _get(payload, "cache_salt", None))

    def _result(self, reply: Mapping[str, Any]) -> RenderedTokens:
        return RenderedTokens.from_wire(reply)


@dataclass
class DetokenizeRenderRequest(RenderTask[RenderedText]):
    """``inference.detokenize``: the text of ``tokens`` (``skip_special_tokens`` as transformers)."""

    task: ClassVar[str] = TASK_DETOKENIZE
    _fields: ClassVar[tuple[str, ...]] = ("tokenizer_dir", "tokens", "skip_special_tokens")

    tokenizer_dir: str
    tokens: list[int]
    skip_special_tokens: bool = False

    cache_salt: ClassVar[None] = None  # nothing of a detokenize is cached per scope

    @classmethod
    def from_wire(cls, payload: object) -> DetokenizeRenderRequest:
        """The request in a task argument; ``tokenizer_dir`` and ``tokens`` are required (``PayloadError``)."""
        return cls(_require(payload, "tokenizer_dir"), _require(payload, "tokens"),
                   bool(_get(payload, "skip_special_tokens", False)))

    def _result(self, reply: Mapping[str, Any]) -> RenderedText:
        return RenderedText.from_wire(reply)


@dataclass
class ImageWorkItem:
    """One image of a chat for the ``mm`` worker: ``part`` names its message part (``messages[0].content[1]``);
    either ``url`` (an http(s) URL to fetch) or ``key`` with ``blob`` (the image's feature-cache key, computed by
    the api, and the Redis key of its bytes, stored there by the api)."""

    part: str
    url: str | None = None
    key: str | None = None
    blob: str | None = None

    def to_wire(self) -> dict[str, str]:
        """``{"part", "url"}`` or ``{"part", "key", "blob"}`` (what ``preprocess_images`` reads)."""
        if self.blob is not None and self.key is not None:
            return {"part": self.part, "key": self.key, "blob": self.blob}
        return {"part": self.part, "url": self.url or ""}

    @classmethod
    def from_wire(cls, item: Mapping[str, Any]) -> ImageWorkItem:
        """Inverse of ``to_wire``."""
        return cls(str(item["part"]), item.get("url"), item.get("key"), item.get("blob"))


@dataclass
class ImagesRequest(RenderTask[PreprocessedImages]):
    """``inference.mm_preprocess``: fetch, decode and process ``items`` for the model in ``model_dir`` into the
    shared feature cache under link prefix ``prefix``, keyed with ``cache_salt``; http(s) fetches limited to
    ``allowed_domains`` (empty: any public host) and ``max_bytes`` (``None``: the worker's default)."""

    task: ClassVar[str] = TASK_MM_PREPROCESS
    queue: ClassVar[str] = MM_QUEUE
    _fields: ClassVar[tuple[str, ...]] = ("prefix", "model_dir", "items", "allowed_domains", "cache_salt",
                                          "max_bytes")

    prefix: str
    model_dir: str
    items: list[ImageWorkItem]
    allowed_domains: list[str] = field(default_factory=list)
    cache_salt: str | None = None
    max_bytes: int | None = None

    def to_wire(self) -> Wire:
        """The task argument (``max_bytes`` only when set)."""
        out: Wire = {"prefix": self.prefix, "model_dir": self.model_dir,
                     "items": [it.to_wire() for it in self.items], "allowed_domains": self.allowed_domains,
                     "cache_salt": self.cache_salt}
        if self.max_bytes is not None:
            out["max_bytes"] = self.max_bytes
        return out

    @classmethod
    def from_wire(cls, payload: object) -> ImagesRequest:
        """The request in a task argument; ``prefix``, ``model_dir`` and ``items`` are required
        (``PayloadError``)."""
        return cls(_require(payload, "prefix"), _require(payload, "model_dir"),
                   [ImageWorkItem.from_wire(it) for it in _require(payload, "items")],
                   list(_get(payload, "allowed_domains", None) or []), _get(payload, "cache_salt", None),
                   _get(payload, "max_bytes", None))

    def _result(self, reply: Mapping[str, Any]) -> PreprocessedImages:
        return PreprocessedImages.from_wire(reply)
