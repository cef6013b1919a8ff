"""Registry writes (keyword-only ``<entity>_<verb>`` services)."""

from __future__ import annotations

import json
from pathlib import Path

from django.core.exceptions import ValidationError
from django.db import transaction

from .models import ServedModel

_UNSET = object()


def served_model_dirs_validate(*, model_dir: str, tokenizer_dir: str | None = None) -> tuple[str, str]:
    """Check a model directory (``config.json``) and tokenizer directory (``tokenizer.json``).

    Returns ``(model_dir, tokenizer_dir)`` as absolute paths; ``tokenizer_dir`` is ``""`` when it is
    the model directory. Raises ``django.core.exceptions.ValidationError`` keyed by field name.
    """
    errors: dict[str, str] = {}
    model_path = Path(model_dir).expanduser().resolve()
    if not model_path.is_dir():
        errors["model_dir"] = f"{model_path} is not a directory."
    elif not (model_path / "config.json").is_file():
        errors["model_dir"] = f"{model_path} has no config.json."
    tokenizer_path = Path(tokenizer_dir).expanduser().resolve() if tokenizer_dir else model_path
    if "model_dir" not in errors or tokenizer_dir:
        field = "tokenizer_dir" if tokenizer_dir else "model_dir"
        if not tokenizer_path.is_dir():
            errors.setdefault(field, f"{tokenizer_path} is not a directory.")
        elif not (tokenizer_path / "tokenizer.json").is_file():
            errors.setdefault(field, f"{tokenizer_path} has no tokenizer.json.")
    if errors:
        raise ValidationError(errors)
    return str(model_path), (str(tokenizer_path) if tokenizer_path != model_path else "")


def model_dir_max_model_len(model_dir: str) -> int:
    """``max_position_embeddings`` from ``<model_dir>/config.json`` (or its ``text_config``).

    Raises ``ValidationError`` (field ``max_model_len``) when the file has no usable value.
    """
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValidationError({"max_model_len": f"cannot read {path}: {exc}"}) from exc
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    raise ValidationError(
        {"max_model_len": f"{path} has no max_position_embeddings; give max_model_len explicitly."}
    )


def served_model_register(
    *,
    served_model_name: str,
    model_dir: str,
    tokenizer_dir: str | None = None,
    max_model_len: int | None = None,
    chat_template: str | None = None,
    allow_request_chat_template: bool | None = None,
    allow_control_tokens_in_content: bool | None = None,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
    max_num_seqs: int | None = None,
    task: str | None = None,
    backend: str | None = None,
    enabled: bool | None = None,
    num_replicas: int | None = None,
) -> ServedModel:
    """Create or update (idempotently, keyed on ``served_model_name``) a ``ServedModel``.

    ``model_dir`` must hold ``config.json``; the tokenizer directory (``tokenizer_dir`` or else
    ``model_dir``) must hold ``tokenizer.json``. ``max_model_len=None`` reads
    ``max_position_embeddings`` from ``config.json``. Other arguments left ``None`` keep the stored
    value on update (the model default on create). Paths are stored absolute.
    Raises ``ValidationError`` on bad directories or field values.
    """
    model_dir_abs, tokenizer_dir_abs = served_model_dirs_validate(model_dir=model_dir, tokenizer_dir=tokenizer_dir)
    if max_model_len is None:
        max_model_len = model_dir_max_model_len(model_dir_abs)
    updates = {
        "model_dir": model_dir_abs,
        "tokenizer_dir": tokenizer_dir_abs,
        "max_model_len": max_model_len,
        "chat_template": chat_template,
        "allow_request_chat_template": allow_request_chat_template,
        "allow_control_tokens_in_content": allow_control_tokens_in_content,
        "reasoning_parser": reasoning_parser,
        "tool_call_parser": tool_call_parser,
        "dtype": dtype,
        "device": device,
        "max_num_seqs": max_num_seqs,
        "num_replicas": num_replicas,
        "task": task,
        "backend": backend,
        "enabled": enabled,
    }
    with transaction.atomic():
        served_model = (
            ServedModel.objects.select_for_update().filter(served_model_name=served_model_name).first()
            or ServedModel(served_model_name=served_model_name)
        )
        for field, value in updates.items():
            if value is not None:
                setattr(served_model, field, value)
        served_model.full_clean()
        served_model.save()
    return served_model
