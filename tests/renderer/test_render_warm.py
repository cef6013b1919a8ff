"""A render worker's child warms what the registry serves: at start, and (``config.celery._keep_warm``, every
``WARM_POLL_S``) a model registered while it runs, so that model's first request does not load a cold tokenizer
inside the 5 s render limit. Real database (pytest-django), real tokenizers."""

from __future__ import annotations

import pytest

from config.celery import _warm_renderer
from inference.renderer import tokenizer_cache
from registry.models import ServedModel
from harness.assets import MODEL_DIR
from tests.renderer.tokdirs import tok_dir


def _loaded(tokenizer_dir: str) -> bool:
    import os

    real = os.path.realpath(tokenizer_dir)
    return any(key[0] == real for key in tokenizer_cache._CACHE)


@pytest.mark.django_db
def test_a_model_registered_later_is_warmed_on_the_next_look_and_only_it():
    qwen, llama = tok_dir("qwen3"), tok_dir("llama2")
    tokenizer_cache.clear_tokenizer_cache()
    ServedModel.objects.create(served_model_name="first", model_dir=str(MODEL_DIR), max_model_len=512, tokenizer_dir=qwen)
    warmed: set[tuple[str, str]] = set()
    _warm_renderer(warmed)
    assert warmed == {(qwen, "")} and _loaded(qwen) and not _loaded(llama)

    ServedModel.objects.create(served_model_name="later", model_dir=str(MODEL_DIR), max_model_len=512, tokenizer_dir=llama)
    ServedModel.objects.create(served_model_name="off", model_dir=str(MODEL_DIR), max_model_len=512, tokenizer_dir=tok_dir("gptoss"),
                               enabled=False)
    tokenizer_cache.clear_tokenizer_cache()  # what is warmed already is not loaded again
    _warm_renderer(warmed, quiet=True)
    assert warmed == {(qwen, ""), (llama, "")}
    assert _loaded(llama) and not _loaded(qwen) and not _loaded(tok_dir("gptoss"))
