"""The gateway's request path, one step per module, in docs/ARCHITECTURE.md §2 order (docs/request_path.md has the
table).

Transport lives beside this package (``gateway.ingress``: before the body; ``gateway.http``: the ASGI consumer,
body cap, disconnect, responses). Then, per request:

1. ``preamble``   authenticate, parse + validate, request ids, resolve the model            401/403/400/404
2. ``limits``     the key's RPM/TPM/concurrency/budget, before any render                   429
3. ``admission``  pre-check (estimate) before rendering, exact reserve after, release       503
4. ``rendering``  chat template + tokenize (Celery ``render`` queue or inline)              400/503
5. ``media``      images: feature-cache lookup, ``mm`` queue, placeholder expansion         400/429/503
6. ``inputs``     input processing → ``EngineCoreRequest`` s (lengths, sampling, n)         400
7. ``engine``     engine link hand-off and output processing (``inference.api.output_processor``)   503
8. ``responses``  OpenAI bodies and SSE chunks
9. ``usage``      the usage event, exactly once
``scope`` holds what a request must give back exactly once; ``flow`` composes the steps for the generating
endpoints; ``failures`` maps lower layers' exceptions to HTTP errors. The process's Redis pool, engine link and
admission client are ``gateway.clients``, beside this package.

Layering (checked by import-linter, pyproject.toml): ``gateway.endpoints`` → ``flow`` → the steps →
``gateway.clients``, ``failures``, ``gateway.errors``; no step imports an endpoint module.
"""
