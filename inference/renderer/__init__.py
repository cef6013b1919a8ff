"""Chat-template rendering, tokenization and the tokenizer cache (Django- and torch-free; transformers only in
``multimodal.get_image_processor``, a lazy load that runs in the ``mm`` workers). Public API:

* ``render_chat(tokenizer_dir, messages, *, add_generation_prompt=True, continue_final_message=False,
  tools=None, documents=None, chat_template=None, chat_template_kwargs=None, add_special_tokens=False,
  allow_control_tokens=False) -> RenderedPrompt(prompt_text, prompt_token_ids)``  (``chat_template.py``;
  control-token strings in request text are encoded as text unless ``allow_control_tokens``)
* ``tokenize_prompt(tokenizer_dir, prompt, add_special_tokens=True) -> list[int]``
* ``detokenize(tokenizer_dir, ids, skip_special_tokens=False) -> str``
* ``get_tokenizer(tokenizer_dir) -> LoadedTokenizer``  (``tokenizer_cache.py``; its ``encode`` assembles long
  texts from the segment tokenization cache, ``segment_cache.py``, with the same ids: a per-process LRU, and in
  render workers a shared tier in Redis behind it)
* errors: ``RenderError`` and subclasses (``errors.py``)
"""

from .chat_template import RenderedPrompt, detokenize, render_chat, tokenize_prompt
from .errors import (
    InvalidMessagesError, InvalidTemplateKwargsError, NoChatTemplateError, RenderError, TemplateLimitError,
    TemplateRenderError, TemplateSecurityError, TemplateSyntaxError, TemplateTimeoutError, TokenIdError,
    TokenizerLoadError,
)
from .tokenizer_cache import LoadedTokenizer, get_tokenizer

__all__ = [
    "InvalidMessagesError",
    "InvalidTemplateKwargsError",
    "LoadedTokenizer",
    "NoChatTemplateError",
    "RenderError",
    "RenderedPrompt",
    "TemplateLimitError",
    "TemplateRenderError",
    "TemplateSecurityError",
    "TemplateSyntaxError",
    "TemplateTimeoutError",
    "TokenIdError",
    "TokenizerLoadError",
    "detokenize",
    "get_tokenizer",
    "render_chat",
    "tokenize_prompt",
]
