"""Loose modules every process imports: the settings (``config``), Redis socket timeouts, prefix block hashing,
the structured-output specs and their caps, marker-aware text buffers for the output parsers, process-tree kills.
Imports nothing from ``api``, ``workers`` or ``engine``."""
