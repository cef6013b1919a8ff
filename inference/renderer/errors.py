"""Errors raised by the renderer (chat templates, tokenization, detokenization).

Every error is a ``RenderError`` (a ``ValueError``), so callers map all of them to HTTP 400 with the
OpenAI error envelope (``invalid_request_error``); ``param`` names the request field to blame, as in
the envelope's ``param``. The one exception is ``TemplateTimeoutError``, which the gateway may map
to 500 like vLLM does (``vllm/renderers/hf.py::_render_with_timeout`` raises ``TimeoutError``) or to
400; it is still a ``RenderError`` so that it is never an unstructured traceback.
"""

from __future__ import annotations


class RenderError(ValueError):
    """Base class of every renderer error.

    Attributes:
        message: human-readable reason, safe to show to the client.
        param: the request field to blame (``"messages"``, ``"chat_template"``,
            ``"chat_template_kwargs"``, ``"tokens"``, ``"prompt"``, ...) or ``None``.
    """

    default_param: str | None = None

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param if param is not None else self.default_param


class NoChatTemplateError(RenderError):
    """The tokenizer has no chat template and none was given (vLLM: ``ChatTemplateResolutionError``)."""

    default_param = "messages"


class InvalidMessagesError(RenderError):
    """The conversation is malformed (not a list of role/content dicts, bad tool_calls, bad parts)."""

    default_param = "messages"


class InvalidTemplateKwargsError(RenderError):
    """``chat_template_kwargs`` (or another template argument) is not acceptable."""

    default_param = "chat_template_kwargs"


class TemplateSyntaxError(RenderError):
    """The chat template is not valid Jinja2."""

    default_param = "chat_template"


class TemplateRenderError(RenderError):
    """The template failed while rendering; ``message`` is the template's own reason when it called
    ``raise_exception(...)``, else the Jinja/Python error text."""

    default_param = "messages"


class TemplateSecurityError(RenderError):
    """The template tried to leave the sandbox (``__class__``, ``__globals__``, mutating methods...)."""

    default_param = "chat_template"


class TemplateLimitError(RenderError):
    """The template exceeded the output-size cap or the operation budget (loop bombs, huge strings)."""

    default_param = "chat_template"


class TemplateTimeoutError(RenderError):
    """Rendering ran past the wall-time limit (Celery soft time limit)."""

    default_param = "messages"


class RenderOverloadedError(RenderError):
    """The wall-time limit ran out while the worker was not rendering the template (loading a tokenizer in a
    cold worker, or starved of CPU): the server's fault, answered as 503 so the client retries."""

    default_param = None


class TokenIdError(RenderError):
    """A token id is not an integer in ``[0, vocab_size)``; the message names the id."""

    default_param = "tokens"


class TokenizerLoadError(RenderError):
    """The tokenizer directory is missing or unreadable (a deployment problem, not a client one)."""

    default_param = None


class ContextLengthError(RenderError):
    """The text has more characters than can fit the model's context whatever its tokenization
    (``max_model_len × longest token string``; vLLM's character pre-check, ``vllm/entrypoints/renderer.py``):
    refused before tokenizing. The gateway answers 400 ``context_length_exceeded``."""

    default_param = "prompt"
