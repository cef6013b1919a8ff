"""Registry models: ``ServedModel`` is one name clients can put in ``"model"`` and how it is served."""

from __future__ import annotations

from django.core.validators import MinValueValidator, RegexValidator
from django.db import models

SERVED_MODEL_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"

served_model_name_validator = RegexValidator(
    SERVED_MODEL_NAME_RE,
    "1-128 characters: letters, digits and . _ : / - (starting with a letter or digit).",
)


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
    dtype = models.CharField(max_length=16, choices=Dtype.choices, default=Dtype.AUTO)
    device = models.CharField(max_length=16, choices=Device.choices, default=Device.CPU)
    max_num_seqs = models.PositiveIntegerField(default=32, validators=[MinValueValidator(1)])
    task = models.CharField(max_length=16, choices=Task.choices, default=Task.GENERATE)
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["served_model_name"]

    def __str__(self) -> str:
        return self.served_model_name

    @property
    def tokenizer_dir_resolved(self) -> str:
        """``tokenizer_dir`` when set, else ``model_dir``."""
        return self.tokenizer_dir or self.model_dir
