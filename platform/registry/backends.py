"""Engine backends: which engine serves a ``ServedModel`` and what each one cannot do.

``native`` is our torch engine (``python -m inference.engine``); ``vllm`` is vLLM's v1 engine behind the same
Redis link (``python -m inference.engine.vllm_backend``, run by the interpreter of the separate ``.peer/vllm``
environment). Both speak the link's wire types (``inference.protocol.engine``), so nothing above the link
branches on the backend; the request path only asks which *features* a model lacks (``unsupported_features``)
and refuses those with a 400 before anything is admitted (DECISIONS D-242).
"""

from __future__ import annotations

# A request that needs one of these is refused (400) on a model whose backend lacks it:
# ``images``: image inputs (the native engine reads image features from the shared multimodal cache by key; vLLM's
# engine would need the pixels and its own processor). ``structured_outputs_after_reasoning``: a structured-output
# constraint that starts after a reasoning model's end-of-thinking token (vLLM sets that up per engine, with
# ``--reasoning-parser``, not per request; a constraint from the first token is served).
IMAGES = "images"
STRUCTURED_AFTER_REASONING = "structured_outputs_after_reasoning"

UNSUPPORTED_FEATURES: dict[str, frozenset[str]] = {
    "native": frozenset(),
    "vllm": frozenset({IMAGES, STRUCTURED_AFTER_REASONING}),
}


def unsupported_features(backend: str) -> list[str]:
    """Sorted feature names ``backend`` cannot serve (an unknown backend: none, as for ``native``)."""
    return sorted(UNSUPPORTED_FEATURES.get(backend, frozenset()))
