"""The HTTP surface of the OpenAI-compatible API (Channels consumers in the api process, no Django views).

* ``endpoints/``  the route modules, one per endpoint; ``routing`` maps URLs to them
* ``pipeline/``   the request path's steps, one per module (preamble, limits, admission, rendering, media, inputs,
  engine, responses, usage), composed by the endpoints
* transport, below both: ``ingress`` (before the body: early refusals, the body deadline), ``http`` (the ASGI
  consumer base: body cap, disconnect, responses), ``handoff`` (image requests relayed to the multimodal api),
  ``lifespan``, ``disconnect``
* infrastructure shared by all of them: ``clients`` (the process's Redis pool, engine link, admission client,
  background tasks), ``auth``, ``model_cache``, ``single_flight``, ``errors``, ``logprobs``

The layering (endpoints above the pipeline above the clients and errors) is checked by import-linter
(pyproject.toml).
"""
