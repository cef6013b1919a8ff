"""A private live platform for tests that kill its processes (so no other test shares the victim)."""

from __future__ import annotations

from tests.support.live import platform_fixture

live = platform_fixture("live-failures", scope="module")
