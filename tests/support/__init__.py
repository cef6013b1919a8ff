"""Helpers shared by the test packages (fixtures stay in each package's conftest; what they share lives here)."""
