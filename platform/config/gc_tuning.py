"""Garbage-collector settings for long-running processes (api, Celery workers, engine replicas).

CPython's cyclic collector walks every tracked object of the generation it collects; a full (generation 2)
collection in a process that has imported Django, Channels, Celery and the tokenizers walks hundreds of
thousands of objects that live as long as the process. Measured in the api process under the image load of
``bench/multimodal.py``: generation-2 pauses of 70 ms and generation-1 pauses of 3-8 ms, each one stalling
every request on that event loop. ``gc.freeze()`` (Python ≥ 3.7, see the ``gc`` module docs) moves every
object alive at that point into a permanent generation the collector ignores, so later collections walk only
objects created since: what Instagram's engineering blog reported for their Django fleet ("Dismissing Python
Garbage Collection at Instagram", 2017), done with the standard library call made for it.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect once, then move every surviving object to the permanent generation. Call after start-up
    imports (and, in a forked child, after the fork). Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
