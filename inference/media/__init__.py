"""Media input for multimodal requests: safe URL fetching (``guard``), image decoding with
bomb limits (``image``) and the shared, bounded Redis cache of processed features (``cache``).

Django-free and torch-free (Pillow and numpy only), so api processes, Celery ``mm`` workers and engines can
all import it.
"""
