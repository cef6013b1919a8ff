"""Live platform for the admission tests (real Redis, worker, beat, engine, two api processes)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/11")

from harness.live_platform import start_platform
from tests.support.live import stop_in_background


@pytest.fixture(scope="package")
def live(tmp_path_factory):
    platform = start_platform(tmp_path_factory.mktemp("adm"))
    _child, platform.extra["api2"] = platform.start_api("api2")
    platform.extra["operator_key"] = platform.new_key(tenant="ops", scopes="operator")
    yield platform
    stop_in_background("admission platform", platform.stop)
