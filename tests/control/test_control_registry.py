"""Model registry: register from a real directory, idempotent updates, validation, selectors, command."""

from __future__ import annotations

import shutil
from io import StringIO

import pytest
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.core.management.base import CommandError

from gateway.model_cache import ModelSnapshot
from registry.models import ServedModel
from registry.selectors import served_model_get, served_model_snapshot, served_models_enabled
from registry.services import served_model_register

pytestmark = pytest.mark.django_db


def test_register_reads_max_model_len_and_snapshot(model_dir):
    served_model = served_model_register(served_model_name="qwen3-tiny", model_dir=str(model_dir))
    assert served_model.max_model_len == 40960
    assert served_model.model_dir == str(model_dir.resolve()) and served_model.tokenizer_dir == ""
    snapshot = served_model_snapshot("qwen3-tiny")
    assert snapshot["name"] == snapshot["served_model_name"] == "qwen3-tiny"
    assert snapshot["tokenizer_dir"] == str(model_dir.resolve())  # resolved: blank -> model_dir
    assert snapshot["chat_template"] is None and snapshot["allow_request_chat_template"] is False
    assert (snapshot["task"], snapshot["enabled"], snapshot["max_model_len"]) == ("generate", True, 40960)
    assert served_model_snapshot("nope") is None and served_model_get("nope") is None


def test_register_is_idempotent_on_name(model_dir, tmp_path):
    first = served_model_register(served_model_name="m", model_dir=str(model_dir), device="cpu", max_num_seqs=8)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    shutil.copy(model_dir / "tokenizer.json", tok_dir / "tokenizer.json")
    second = served_model_register(
        served_model_name="m", model_dir=str(model_dir), tokenizer_dir=str(tok_dir), max_model_len=2048,
        chat_template="{{ messages[0]['content'] }}",
    )
    assert second.pk == first.pk and ServedModel.objects.count() == 1
    second.refresh_from_db()
    assert second.max_model_len == 2048 and second.max_num_seqs == 8  # unspecified fields kept
    assert served_model_snapshot("m")["tokenizer_dir"] == str(tok_dir.resolve())
    assert served_model_snapshot("m")["chat_template"] == "{{ messages[0]['content'] }}"


def test_register_validates_directories(model_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValidationError) as info:
        served_model_register(served_model_name="x", model_dir=str(empty))
    assert "config.json" in str(info.value)
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(ValidationError) as info:
        served_model_register(served_model_name="x", model_dir=str(model_dir))
    assert "tokenizer.json" in str(info.value)
    with pytest.raises(ValidationError):
        served_model_register(served_model_name="x", model_dir=str(tmp_path / "missing"))
    assert ServedModel.objects.count() == 0


def test_register_validates_fields(model_dir):
    with pytest.raises(ValidationError):
        served_model_register(served_model_name="bad name!", model_dir=str(model_dir))
    with pytest.raises(ValidationError):
        served_model_register(served_model_name="ok", model_dir=str(model_dir), device="tpu")
    with pytest.raises(ValidationError):
        served_model_register(served_model_name="ok", model_dir=str(model_dir), max_model_len=0)
    assert ServedModel.objects.count() == 0


def test_enabled_selector(model_dir):
    served_model_register(served_model_name="b", model_dir=str(model_dir))
    served_model_register(served_model_name="a", model_dir=str(model_dir))
    served_model_register(served_model_name="c", model_dir=str(model_dir), enabled=False)
    assert [m.served_model_name for m in served_models_enabled()] == ["a", "b"]
    assert served_model_snapshot("c")["enabled"] is False


def test_register_model_command(model_dir):
    out = StringIO()
    call_command("register_model", "Qwen/Qwen3-tiny", str(model_dir), "--max-model-len", "4096",
                 "--device", "cpu", "--dtype", "float32", stdout=out)
    assert "registered Qwen/Qwen3-tiny" in out.getvalue()
    served_model = served_model_get("Qwen/Qwen3-tiny")
    assert (served_model.max_model_len, served_model.dtype) == (4096, "float32")
    with pytest.raises(CommandError):
        call_command("register_model", "x", str(model_dir / "nope"), stdout=StringIO())


def test_output_parser_fields_default_auto_validated_and_in_the_snapshot(model_dir):
    served_model_register(served_model_name="parsers", model_dir=str(model_dir))
    snap = served_model_snapshot("parsers")
    assert (snap["reasoning_parser"], snap["tool_call_parser"]) == ("auto", "auto")
    served_model_register(served_model_name="parsers", model_dir=str(model_dir), reasoning_parser="deepseek_r1",
                          tool_call_parser="llama3_json")
    cached = ModelSnapshot.from_dict(served_model_snapshot("parsers"))
    assert (cached.reasoning_parser, cached.tool_call_parser) == ("deepseek_r1", "llama3_json")
    for field in ("reasoning_parser", "tool_call_parser"):
        with pytest.raises(ValidationError) as exc:
            served_model_register(served_model_name="parsers", model_dir=str(model_dir), **{field: "nope"})
        assert field in exc.value.message_dict
