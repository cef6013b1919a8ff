"""Live-platform fixture for the usage/key live tests (real Redis, worker, beat, engine, uvicorn)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def live(shared_live):
    """The shared live platform (tests/conftest.py)."""
    return shared_live


@pytest.fixture(scope="session")
def model_name():
    return "tiny-qwen3"
