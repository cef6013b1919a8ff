"""Live-platform fixture for the usage/key live tests (real Redis, worker, beat, engine, uvicorn)."""

from __future__ import annotations

import pytest

from tests.live_platform import start_platform


@pytest.fixture(scope="session")
def live(tmp_path_factory):
    platform = start_platform(tmp_path_factory.mktemp("live-usage"))
    yield platform
    platform.stop()


@pytest.fixture(scope="session")
def model_name():
    return "tiny-qwen3"
