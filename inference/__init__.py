"""The Django-free side of the platform, grouped by the process that runs the code (docs/ARCHITECTURE.md, Layout).

* ``api/``      runs in the api process beside the gateway: admission, the engine link's client side and its
  router, the render client, input and output processing, the structured-output sandbox pool
* ``workers/``  the Celery render workers' tasks (chat templates, tokenizing, image preprocessing) and the limits a
  worker enforces on itself
* ``engine/``   the engine worker process: replica link, scheduler, model runners, caches (``python -m
  inference.engine``; the vLLM backend in ``engine/vllm_backend``)
* ``shared/``   loose modules every process imports: settings, prefix hashing, grammar caps, marker buffers
* libraries used by more than one process, each a package: ``protocol/`` (the wire shapes between processes),
  ``renderer/`` (templates, tokenizers, segment cache), ``media/`` (image fetch and decode, feature cache),
  ``reasoning/`` and ``tool_parsers/`` (output parsers)

Which group may import which is checked by import-linter (pyproject.toml).
"""
