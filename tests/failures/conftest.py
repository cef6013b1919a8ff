"""A private live platform for tests that kill its processes (so no other test shares the victim)."""

from __future__ import annotations

import pytest

from tests.live_platform import start_platform


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    platform = start_platform(tmp_path_factory.mktemp("live-failures"))
    yield platform
    platform.stop()
