"""Live-platform fixture for the usage/key live tests (real Redis, worker, beat, engine, uvicorn)."""

from __future__ import annotations

import pytest

from tests.support.live import platform_fixture

live = platform_fixture("live-usage", scope="package")


@pytest.fixture(scope="session")
def model_name():
    return "tiny-qwen3"
