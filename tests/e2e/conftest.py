"""Session fixture: one live platform shared by the end-to-end tests (see tests/live_platform.py)."""

from __future__ import annotations

import pytest

from tests.support.live import platform_fixture

live = platform_fixture("live", scope="package")


@pytest.fixture(scope="session")
def model_name():
    return "tiny-qwen3"
