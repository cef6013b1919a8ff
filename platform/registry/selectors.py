"""Registry reads."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from .backends import unsupported_features
from .models import ServedModel


def served_model_get(name: str) -> ServedModel | None:
    """The ``ServedModel`` named ``name`` (enabled or not), or ``None``."""
    return ServedModel.objects.filter(served_model_name=name).first()


def served_models_enabled() -> QuerySet[ServedModel]:
    """Enabled served models, ordered by ``served_model_name``."""
    return ServedModel.objects.filter(enabled=True).order_by("served_model_name")


def served_model_snapshot_from(served_model: ServedModel) -> dict[str, Any]:
    """Plain, JSON/msgpack-serializable dict of what the request path needs from ``served_model``.

    Keys: ``name`` and ``served_model_name`` (same value), ``model_dir``, ``tokenizer_dir`` (resolved:
    never blank), ``max_model_len``, ``chat_template`` (``None`` = the tokenizer's own),
    ``allow_request_chat_template``, ``allow_control_tokens_in_content``, ``reasoning_parser`` and
    ``tool_call_parser`` (the registry's setting: ``auto``, ``none`` or a parser name), ``task``, ``enabled``, ``dtype``, ``device``, ``max_num_seqs``,
    ``unsupported_features`` (what the model's engine backend cannot serve: ``registry.backends``; the backend
    itself is not in the snapshot, the request path never branches on it), ``revision`` (``updated_at`` as ISO-8601; changes on every edit, usable as a cache key).
    """
    return {
        "name": served_model.served_model_name,
        "served_model_name": served_model.served_model_name,
        "model_dir": served_model.model_dir,
        "tokenizer_dir": served_model.tokenizer_dir_resolved,
        "max_model_len": served_model.max_model_len,
        "chat_template": served_model.chat_template or None,
        "allow_request_chat_template": served_model.allow_request_chat_template,
        "allow_control_tokens_in_content": served_model.allow_control_tokens_in_content,
        "reasoning_parser": served_model.reasoning_parser,
        "tool_call_parser": served_model.tool_call_parser,
        "task": served_model.task,
        "enabled": served_model.enabled,
        "dtype": served_model.dtype,
        "device": served_model.device,
        "max_num_seqs": served_model.max_num_seqs,
        "unsupported_features": unsupported_features(served_model.backend),
        "revision": served_model.updated_at.isoformat() if served_model.updated_at else "",
    }


def served_model_snapshot(name: str) -> dict[str, Any] | None:
    """Snapshot dict (see ``served_model_snapshot_from``) of the model named ``name``, or ``None``."""
    served_model = served_model_get(name)
    return served_model_snapshot_from(served_model) if served_model is not None else None
