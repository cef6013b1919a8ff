"""A dry run of a constraint's first tokens, so grammars the engine's matcher would give up on are refused before
the request is admitted (a 400 before any stream byte) rather than failing at the engine's first token.

``validate_grammar_with_warnings`` checks a grammar's form, not what its matcher does: a rule or ``$ref`` that only
refers to itself (``root ::= root``, ``{"anyOf": [{"$ref": "#"}]}``), a counted repetition or literal too large for
the lexer (``a{100000}``, a 60 KB choice, 60,000 newlines) and an object that must contain itself pass it, then the
engine's matcher fails within its first two masks (``NoExtensionBias``, "too many expressions constructed", "Too
many items") and a streamed request got a 200 and an in-band error. Those failures come from the grammar alone, so a
matcher over a 257-token byte vocabulary finds them too, in milliseconds: ``probe`` builds one under the engine's
``parser_limits`` and follows the lowest allowed byte for ``PROBE_STEPS`` steps.

It is a probe, not a proof: a grammar can still fail the engine on a path the probe did not take, or over the real
vocabulary (the engine then fails that request with ``structured_output_failed``, D-324). Runs in the grammar
sandbox's worker, inside its CPU budget (``inference.api.structured_sandbox``)."""

from __future__ import annotations

from functools import lru_cache

import llguidance

from inference.shared.structured_caps import StructuredSpecError

PROBE_STEPS = 8  # masks computed: every failure seen in review came at the first or second
EOS_BYTE_TOKEN = 256

# what the matcher's error means, for the client: (text in the library's message, our explanation)
_MEANINGS = (
    ("NoExtensionBias", "refers to itself without ever producing any text (a rule or $ref cycle with no way out)"),
    ("too many expressions", "is too large for the engine's lexer (a repetition count, literal or alternation that "
                             "builds too many states)"),
    ("Too many items", "is too ambiguous or recursive for the engine's parser (e.g. an object that must contain "
                       "itself)"),
)


class _ByteVocabulary:
    """A vocabulary of the 256 bytes and an end-of-sequence token, in the shape ``llguidance.TokenizerWrapper``
    reads (``tokens``, ``eos_token_id``, ``bos_token_id``, ``special_token_ids``, a callable encoder)."""

    eos_token_id = EOS_BYTE_TOKEN
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [EOS_BYTE_TOKEN]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


@lru_cache(maxsize=1)
def byte_tokenizer() -> llguidance.LLTokenizer:
    """The byte-vocabulary ``LLTokenizer`` (built once per process)."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))


def _first_allowed(bitmask: bytes) -> int | None:
    for i, byte in enumerate(bitmask):
        if byte:
            return i * 8 + (byte & -byte).bit_length() - 1
    return None


def probe(grammar: str, limits: llguidance.LLParserLimits) -> None:
    """Run ``grammar`` (an engine grammar, ``inference.shared.structured.engine_grammar``) under ``limits`` for up
    to ``PROBE_STEPS`` masks over the byte vocabulary, taking the lowest allowed byte each step. Raises
    ``StructuredSpecError`` (a client-facing reason) when the matcher fails; returns when it does not."""
    matcher = llguidance.LLMatcher(byte_tokenizer(), grammar, log_level=0, limits=limits)
    for _ in range(PROBE_STEPS):
        if matcher.is_error():
            break
        token = _first_allowed(matcher.compute_bitmask())
        if matcher.is_error() or token is None or token == EOS_BYTE_TOKEN:
            break
        matcher.consume_token(token)
    if matcher.is_error():
        raise StructuredSpecError(matcher_error_reason(matcher.get_error()))


def matcher_error_reason(error: str) -> str:
    """The client's reason for an llguidance matcher's ``error`` (after "the constraint ..."): its meaning when known,
    else the library's first line without its markup. Used by the probe and by the engine's failed rows."""
    for marker, meaning in _MEANINGS:
        if marker in error:
            return meaning
    first = next((ln.strip() for ln in error.splitlines() if ln.strip() and not ln.startswith("<")), "")
    return f"cannot be followed by the engine: {first[:300] or 'the grammar matcher failed'}"
