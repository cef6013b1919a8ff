"""Helpers shared by the test packages (fixtures stay in each package's conftest; what they share lives here). What
the tests share with the benchmarks (the live platform, ``manage.py serve``, the drills, the demo models) is in
``harness/``."""
