"""The gateway's request path in docs/ARCHITECTURE.md §2 order, its steps in the modules of this package
(docs/request_path.md has the table of files and functions).

Steps 1-2 are transport, beside this package: ``config.asgi`` with ``gateway.ingress`` (refusals from the headers,
body deadlines) and ``gateway.handoff`` (image requests relayed to the multimodal api), then ``gateway.http`` (the
ASGI consumer: body cap, disconnect, responses). Then, per request, with the modules that run each step:

3. ``preamble``, ``limits``   authenticate; the key's RPM and concurrency, before the body is parsed   401/403/429
4. ``preamble``               parse + validate, request ids; ``scope`` opens (what the request holds)   400
5. ``preamble``               resolve the model                                                         400/404/403
6. ``limits``, ``admission``  the key's token estimate, then the admission pre-check, before rendering  429/503
7. ``inputs``, ``rendering``, ``media``: output constraint, tokenizer, chat template + tokenize (Celery ``render``
   queue or inline), images (feature cache, ``mm`` queue)                                                400/429/503
8. ``inputs``                 input processing → ``EngineCoreRequest`` s (lengths, sampling, n)         400
9. ``admission``, ``engine``  exact reserve, then the engine link hand-off                              503
10. ``responses``, ``engine`` SSE chunks or the body, output processing (``inference.api.output_processor``);
    ``admission.release_prefill`` at each child's first token                                           in-band
11. ``scope``                 release once: the ``usage`` event, the run closed, admission, ``limits`` settled

``flow`` composes steps 6-9 for the generating endpoints; ``failures`` maps lower layers' exceptions to HTTP
errors. The process's Redis pool, engine link and admission client are ``gateway.clients``, beside this package.

Layering (checked by import-linter, pyproject.toml): ``gateway.endpoints`` → ``flow`` → the steps →
``gateway.clients``, ``failures``, ``gateway.errors``; no step imports an endpoint module.
"""
