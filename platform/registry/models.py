"""Registry models: ``ServedModel`` is one name clients can put in ``"model"`` and how it is served."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models

from inference.reasoning import REASONING_PARSERS
from inference.tool_parsers import TOOL_PARSERS

SERVED_MODEL_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"

served_model_name_validator = RegexValidator(
    SERVED_MODEL_NAME_RE,
    "1-128 characters: letters, digits and . _ : / - (starting with a letter or digit).",
)

PARSER_KEYWORDS = ("auto", "none", "")


def reasoning_parser_validator(value: str) -> None:
    """``auto``, ``none``/blank or a registered reasoning parser (``inference.reasoning.REASONING_PARSERS``)."""
    if value not in PARSER_KEYWORDS and value not in REASONING_PARSERS:
        raise ValidationError(f"Unknown reasoning parser {value!r}; use auto, none or one of "
                              f"{sorted(REASONING_PARSERS)}.")


def tool_call_parser_validator(value: str) -> None:
    """``auto``, ``none``/blank or a registered tool-call parser (``inference.tool_parsers.TOOL_PARSERS``)."""
    if value not in PARSER_KEYWORDS and value not in TOOL_PARSERS:
        raise ValidationError(f"Unknown tool-call parser {value!r}; use auto, none or one of "
                              f"{sorted(TOOL_PARSERS)}.")


class ServedModel(models.Model):
    """A model served under ``served_model_name`` (vLLM's ``--served-model-name``).

    ``tokenizer_dir`` blank means ``model_dir``; ``chat_template`` blank means the tokenizer's own
    template (``tokenizer_config.json`` / ``chat_template.jinja``), non-blank overrides it.
    """

    class Dtype(models.TextChoices):
        AUTO = "auto", "auto"
        FLOAT32 = "float32", "float32"
        BFLOAT16 = "bfloat16", "bfloat16"
        FLOAT16 = "float16", "float16"

    class Device(models.TextChoices):
        CPU = "cpu", "cpu"
        CUDA = "cuda", "cuda"

    class Task(models.TextChoices):
        GENERATE = "generate", "generate"
        EMBED = "embed", "embed"

    class Backend(models.TextChoices):
        NATIVE = "native", "native (our torch engine)"
        VLLM = "vllm", "vllm (vLLM's engine behind the same link)"

    served_model_name = models.CharField(max_length=128, unique=True, validators=[served_model_name_validator])
    model_dir = models.CharField(max_length=1024, help_text="Directory with config.json and the weights.")
    tokenizer_dir = models.CharField(
        max_length=1024, blank=True, default="", help_text="Directory with tokenizer.json; blank = model_dir."
    )
    max_model_len = models.PositiveIntegerField(
        validators=[MinValueValidator(1)], help_text="Prompt + completion tokens per request."
    )
    chat_template = models.TextField(
        blank=True, default="", help_text="Jinja2 chat template override; blank = the tokenizer's own."
    )
    allow_request_chat_template = models.BooleanField(
        default=False, help_text="Accept a client-supplied chat_template in requests."
    )
    allow_control_tokens_in_content = models.BooleanField(
        default=False,
        help_text="Let special-token strings inside request text (message content, tool results, names, "
                  "arguments, documents) become control tokens, as transformers and vLLM do. Off: they are "
                  "encoded as plain text and only the chat template's own markup yields control tokens.",
    )
    reasoning_parser = models.CharField(
        max_length=64, blank=True, default="auto", validators=[reasoning_parser_validator],
        help_text="How reasoning is split off the output into message.reasoning: 'auto' (from the chat template: "
                  "qwen3 when it renders <think>, deepseek_r1 for DeepSeek templates), 'none' (never), or a parser "
                  "name (inference/reasoning/).",
    )
    tool_call_parser = models.CharField(
        max_length=64, blank=True, default="auto", validators=[tool_call_parser_validator],
        help_text="How tool calls are read from the output for tool_choice 'auto': 'auto' (from the chat "
                  "template: hermes for <tool_call>, llama3_json for Llama 3.1's <|python_tag|>), 'none' (never: "
                  "calls stay content), or a parser name (inference/tool_parsers/).",
    )
    dtype = models.CharField(max_length=16, choices=Dtype.choices, default=Dtype.AUTO)
    device = models.CharField(max_length=16, choices=Device.choices, default=Device.CPU)
    max_num_seqs = models.PositiveIntegerField(default=32, validators=[MinValueValidator(1)])
    num_replicas = models.PositiveIntegerField(
        default=1, validators=[MinValueValidator(1)],
        help_text="Engine processes `manage.py serve` runs for this model on this machine; the api routes each "
                  "request to one of them by prompt-prefix cache hit and load (inference/api/router.py).",
    )
    task = models.CharField(max_length=16, choices=Task.choices, default=Task.GENERATE)
    backend = models.CharField(
        max_length=16, choices=Backend.choices, default=Backend.NATIVE,
        help_text="Engine that serves it: 'native' (inference.engine) or 'vllm' (vLLM's engine in its own "
                  "environment, .peer/vllm; text generation only). Clients see no difference; what a backend "
                  "cannot do is refused with a 400 (README, 'Engine backends').",
    )
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["served_model_name"]

    def __str__(self) -> str:
        return self.served_model_name

    def clean(self) -> None:
        """A vLLM-backed model serves text generation only (the link's pooling mode and image features are the
        native engine's)."""
        super().clean()
        if self.backend == self.Backend.VLLM and self.task != self.Task.GENERATE:
            raise ValidationError({"backend": "The vllm backend serves task 'generate' only."})

    @property
    def tokenizer_dir_resolved(self) -> str:
        """``tokenizer_dir`` when set, else ``model_dir``."""
        return self.tokenizer_dir or self.model_dir
