"""The Celery render workers' code: the render, tokenize, detokenize and image-preprocessing task bodies (the api's
inline route runs the same bodies on its thread pool) and the time limits a ``solo`` worker enforces on itself.
Imports ``shared`` and the library packages, never ``api`` or ``engine``."""
