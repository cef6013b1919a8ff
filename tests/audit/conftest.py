"""Fixtures for the audit tests: a real model directory (the registry's admin and command read it)."""

from tests.control.conftest import model_dir  # noqa: F401  (re-exported fixture)
