"""The gateway's route modules, one per endpoint (vLLM's per-endpoint serving modules): each holds the Channels
consumer(s) that ``gateway.routing`` maps to a URL and composes the request path out of ``gateway.pipeline``.

* ``chat``          ``POST /v1/chat/completions``
* ``completions``   ``POST /v1/completions``
* ``generate``      ``POST /inference/v1/generate``, ``POST /inference/v1/abort_requests`` (tokens in, tokens out)
* ``embeddings``    ``POST /v1/embeddings``
* ``render``        ``POST /v1/chat/completions/render``, ``POST /v1/completions/render``
* ``tokenize``      ``POST /tokenize``, ``POST /detokenize``
* ``models_api``    ``GET /v1/models``, ``GET /v1/models/{model}``
* ``openapi``       ``GET /v1/openapi.json``
* ``metrics``       ``GET /metrics``
* ``health``        ``GET /health`` and the JSON 404 of unknown API routes

No endpoint imports another (an import-linter contract in pyproject.toml): what two of them share lives in
``gateway.pipeline`` or beside it.
"""
