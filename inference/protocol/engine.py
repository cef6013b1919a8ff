"""Engine wire types: what crosses the Redis engine link between `api` processes and engine replicas.

Importable without Django and without torch. Every type is a plain dataclass that round-trips through
msgpack (``to_wire`` / ``from_wire``); field names follow vLLM's v1 engine (``EngineCoreRequest``,
``EngineCoreOutput``, ``SamplingParams``), see ``vllm/v1/engine/__init__.py``.

Link layout (docs/ARCHITECTURE.md §6), all keys prefixed by ``link_prefix`` (default ``llmp``):

* ``{p}:engine:{model}:requests``  Redis Stream, consumer group ``engines``; one entry per
  ``EngineCoreRequest`` (field ``r`` = msgpack bytes), or one per group of ``n`` children of one API
  request (field ``g``, the shared fields once: ``pack_requests``). Every replica of ``model`` is a consumer of the
  group, so replicas share one queue.
* ``{p}:engine:{model}:control``  Redis Stream read (without a group) by every replica of ``model``;
  entries ``{"a": msgpack([request_id, ...])}`` abort those internal request ids wherever they run.
* ``{p}:api:{client_id}:outputs``  Redis Stream, one per api process; one entry per engine step that
  has outputs for that process (field ``o`` = msgpack of ``EngineCoreOutputs``).
* ``{p}:api:{client_id}:alive``  string with TTL ``API_ALIVE_TTL_S`` refreshed by an api process while it
  has requests in flight; engines abort requests whose client key is gone.
* ``{p}:engine:{model}:replica:{engine_id}``  string with a TTL of ``HEARTBEAT_TTL_S``, refreshed
  every ``HEARTBEAT_INTERVAL_S`` by a live replica; value = msgpack of ``EngineStats``.
* ``{p}:engine:{model}:replicas``  sorted set: replica id → heartbeat expiry (Unix ms), updated with each
  heartbeat; live replicas = members scored after now (then MGET their heartbeat keys). Members expired more than
  a minute ago are dropped, and the set itself expires a minute after its model's last heartbeat.
* ``{p}:engine:{model}:rq:{engine_id}``  Redis Stream, consumer group ``engines``: the requests an api process
  routed to that replica (prefix-aware routing, ``inference.api.router``). The replica reads it before the shared
  stream; once the replica's heartbeat lapses, a live replica of the model takes what is left in it.
* ``{p}:engine:{model}:blocks:{engine_id}``  set of the prefix-cache block hashes (16 bytes each) the replica
  holds (``inference.engine.prefix_cache.block_hashes``), kept in step with its cache; TTL refreshed by the
  heartbeat. The router asks it (SMISMEMBER) how much of a prompt each replica has cached.
* ``{p}:engine:{model}:routing``  hash of routing counts for ``/metrics``: ``requests:{engine_id}`` and
  ``hit_tokens:{engine_id}`` (prompt tokens the router expected to be cached there), dropped with the replica's
  stream once it is long dead; ``resent`` (requests waiting on a replica when it died, sent again to a live one:
  ``EngineLink._resend``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

import msgpack

HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TTL_S = 3.0
# a replica expired this recently has its own stream watched for requests to take over (``ReplicaLink._take_over``, engine/replica_link.py);
# the replicas index outlives its model's last heartbeat that long (its expiry, set with every heartbeat)
DEAD_REPLICA_WATCH_MS = 60_000
REPLICAS_INDEX_TTL_MS = int(HEARTBEAT_TTL_S * 1000) + DEAD_REPLICA_WATCH_MS
API_ALIVE_TTL_S = 10
ENGINE_GROUP = "engines"

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"
# ``EngineCoreOutput.error_code`` of a request whose output constraint failed in the engine (a grammar the library
# gave up on: its limits, a token it refused): the client's to change, not a retryable engine failure
ERROR_STRUCTURED_OUTPUT = "structured_output_failed"


def requests_stream(prefix: str, model: str) -> str:
    """Redis key of the request stream shared by every replica of ``model``."""
    return f"{prefix}:engine:{model}:requests"


def replica_requests_stream(prefix: str, model: str, engine_id: str) -> str:
    """Redis key of the request stream of one replica (requests routed to it; consumer group ``ENGINE_GROUP``)."""
    return f"{prefix}:engine:{model}:rq:{engine_id}"


def replica_blocks_key(prefix: str, model: str, engine_id: str) -> str:
    """Redis key of the set of prefix-cache block hashes one replica holds."""
    return f"{prefix}:engine:{model}:blocks:{engine_id}"


def routing_key(prefix: str, model: str) -> str:
    """Redis hash of routing counts (``requests:{engine_id}``, ``hit_tokens:{engine_id}``, ``resent``) for
    ``/metrics``."""
    return f"{prefix}:engine:{model}:routing"


def control_stream(prefix: str, model: str) -> str:
    """Redis key of the abort/control stream every replica of ``model`` reads."""
    return f"{prefix}:engine:{model}:control"


def outputs_stream(prefix: str, client_id: str) -> str:
    """Redis key of the output stream of one api process (``client_id``)."""
    return f"{prefix}:api:{client_id}:outputs"


def replica_key(prefix: str, model: str, engine_id: str) -> str:
    """Redis key of one replica's heartbeat (string with TTL)."""
    return f"{prefix}:engine:{model}:replica:{engine_id}"


def api_alive_key(prefix: str, client_id: str) -> str:
    """Redis key an api process refreshes (TTL ``API_ALIVE_TTL_S``) while it waits on engine outputs;
    engines abort the requests of a client whose key is gone."""
    return f"{prefix}:api:{client_id}:alive"


def replicas_index_key(prefix: str, model: str) -> str:
    """Sorted set of ``model``'s replica ids scored by heartbeat expiry (Unix ms): readers find the live
    replicas with one ZRANGEBYSCORE instead of scanning the keyspace."""
    return f"{prefix}:engine:{model}:replicas"


def live_replica_keys(ids: Sequence[Any], prefix: str, model: str) -> list[str]:
    """Heartbeat keys of the replica ids returned by the index (bytes or str)."""
    return [replica_key(prefix, model, i.decode() if isinstance(i, bytes) else i) for i in ids]


def replica_pattern(prefix: str, model: str) -> str:
    """SCAN pattern matching every live replica heartbeat of ``model``."""
    return f"{prefix}:engine:{model}:replica:*"


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class SamplingParams:
    """Fully resolved per-request sampling parameters, as the engine applies them.

    Semantics follow vLLM's ``SamplingParams`` (``vllm/sampling_params.py``):

    * ``temperature`` 0 means greedy; ``top_p`` in (0, 1]; ``top_k`` 0 or -1 disables;
      ``min_p`` in [0, 1].
    * ``seed``: per-request generator seed; ``None`` = nondeterministic.
    * ``max_tokens`` ≥ 1: output tokens to generate at most (finish ``length``).
    * ``min_tokens``: EOS and ``stop_token_ids`` are masked until this many tokens exist.
    * ``stop_token_ids``: extra ids that end the sequence (finish ``stop``, ``stop_reason`` = id).
    * ``eos_token_ids``: the model's EOS ids (from its generation config); ignored when
      ``ignore_eos``.
    * ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] (OpenAI), ``repetition_penalty`` > 0
      (HF/CTRL style, 1 = off), applied over the output tokens (presence/frequency) and prompt+output
      (repetition) as vLLM does.
    * ``logit_bias``: token id → bias added to the logits, values in [-100, 100].
    * ``logprobs``: ``None`` = none; k ≥ 0 = the sampled token's logprob plus the top k.
    * ``prompt_logprobs`` (vLLM's field): ``None`` = none; k ≥ 0 = for every prompt position after the first,
      the logprob of the prompt token there plus the top k, from the same (vocabulary-masked) distribution
      as ``logprobs``. The engine then prefills the prompt on its own, in chunks with every position's
      logits, and never from the prefix cache; the entries come back on the output with the first token.
    * ``vocab_size``: only ids below it may be sampled (the served tokenizer can decode them; it may be
      smaller than the model's embedding); 0 = the engine's own limit.
    * Structured outputs (vLLM's ``StructuredOutputsParams``, flattened for the wire): ``structured_kind`` is
      ``None`` (unconstrained) or one of ``STRUCTURED_KINDS``; ``structured_spec`` its text: a JSON schema
      (``"json"``), ``""`` (``"json_object"``: any JSON object), a regular expression (``"regex"``), a JSON
      list of strings (``"choice"``) or a Lark grammar (``"grammar"``). The engine masks every step's logits
      to the tokens the grammar allows. ``structured_after_token_ids``: the constraint starts only after
      one of these ids was generated (a reasoning model's end-of-thinking token); empty = from the first token.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    vocab_size: int = 0
    structured_kind: str | None = None
    structured_spec: str = ""
    structured_after_token_ids: list[int] = field(default_factory=list)


@dataclass
class EngineCoreRequest:
    """One generation request as an engine replica receives it.

    ``request_id`` is the internal, unique id (``external_req_id + "-" + 8 hex``); ``client_id`` names
    the api process whose output stream receives the outputs; ``arrival_time`` is a Unix time in
    seconds taken when the api process received the HTTP request.
    """

    request_id: str
    external_req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    client_id: str
    arrival_time: float
    priority: int = 0
    # Optional additions, defaults keep old senders valid:
    # ``pooling``: an encode (embedding) request: the engine answers with one output carrying ``pooled``
    # and ``finish_reason == "stop"``; ``sampling_params`` are ignored then (a pooling-mode engine refuses
    # requests without it, a generate engine refuses requests with it).
    # ``mm_cache_keys``: one key per image of the prompt, in prompt order, naming the processed features in
    # the shared multimodal cache (``inference.media.cache``); the engine reads the features from there, so
    # the pixels never cross the link.
    pooling: bool = False
    mm_cache_keys: list[str] = field(default_factory=list)
    # ``cache_salt`` (vLLM's ``EngineCoreRequest.cache_salt``): mixed into the hash of the prompt's
    # first prefix-cache block, so cached prefixes are shared only between requests with the same salt. The
    # gateway sets it from the caller's cache group (and the request's own ``cache_salt``); ``None`` = unsalted.
    cache_salt: str | None = None

    def to_wire(self) -> bytes:
        """Serialise to msgpack bytes (fields as a map; ``sampling_params`` as a nested map). Built from the
        instances' ``__dict__`` rather than ``dataclasses.asdict``, which deep-copies every list (a prompt
        of thousands of ids) before msgpack reads it once."""
        data: bytes = msgpack.packb({**self.__dict__, "sampling_params": dict(self.sampling_params.__dict__)},
                                    use_bin_type=True)
        return data

    @classmethod
    def from_wire(cls, data: bytes) -> EngineCoreRequest:
        """Inverse of ``to_wire``. Raises ``TypeError``/``ValueError`` on malformed data."""
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
        sp = raw.pop("sampling_params")
        sp["logit_bias"] = {int(k): float(v) for k, v in (sp.get("logit_bias") or {}).items()}
        return cls(sampling_params=SamplingParams(**sp), **raw)


def pack_requests(requests: list[EngineCoreRequest]) -> list[dict[str, bytes]]:
    """Request-stream entries (Redis stream field maps) for ``requests``, in order.

    The ``n`` children of one API request differ only in ``request_id`` and ``sampling_params.seed``: a run
    of consecutive requests that share everything else (the same prompt list object, equal other fields)
    becomes one entry ``{"g": msgpack({"shared": <request map without request_id, seed>, "children":
    [[request_id, seed], ...]})}``, so the prompt, ``stop_token_ids``, ``eos_token_ids`` and ``logit_bias``
    cross the link (and sit in the stream) once per request, not ``n`` times. Any other request is one
    entry ``{"r": to_wire()}``. ``unpack_entry`` is the inverse.
    """
    entries: list[dict[str, bytes]] = []
    i = 0
    while i < len(requests):
        first = requests[i]
        j = i + 1
        if not first.pooling:
            shared = _shared_map(first)
            while j < len(requests) and requests[j].prompt_token_ids is first.prompt_token_ids \
                    and _shared_map(requests[j]) == shared:
                j += 1
        if j - i == 1:
            entries.append({"r": first.to_wire()})
        else:
            children = [[r.request_id, r.sampling_params.seed] for r in requests[i:j]]
            entries.append({"g": msgpack.packb({"shared": shared, "children": children}, use_bin_type=True)})
        i = j
    return entries


def _shared_map(req: EngineCoreRequest) -> dict[str, Any]:
    sp = {k: v for k, v in req.sampling_params.__dict__.items() if k != "seed"}
    return {**{k: v for k, v in req.__dict__.items() if k != "request_id"}, "sampling_params": sp}


def unpack_entry(fields: dict[bytes, bytes]) -> list[EngineCoreRequest]:
    """The requests of one request-stream entry (``{b"r": ...}`` or ``{b"g": ...}``, see
    ``pack_requests``). Children of a group share one prompt list and one ``stop_token_ids`` /
    ``eos_token_ids`` / ``logit_bias`` object (read-only on the engine). Raises ``TypeError`` /
    ``ValueError`` / ``KeyError`` on malformed data; ``[]`` for an entry with neither field."""
    raw = fields.get(b"r")
    if raw is not None:
        return [EngineCoreRequest.from_wire(raw)]
    raw = fields.get(b"g")
    if raw is None:
        return []
    group = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    shared = group["shared"]
    sp = shared.pop("sampling_params")
    sp["logit_bias"] = {int(k): float(v) for k, v in (sp.get("logit_bias") or {}).items()}
    return [EngineCoreRequest(request_id=str(rid), sampling_params=SamplingParams(**sp, seed=seed), **shared)
            for rid, seed in group["children"]]


@dataclass
class EngineCoreOutput:
    """What one engine step produced for one request.

    * ``new_token_ids``: ids generated this step (usually one).
    * ``new_logprobs``: when requested, one entry per new token:
      ``[sampled_logprob, [[token_id, logprob], ...top-k by logprob, descending]]``.
    * ``finish_reason``: ``None`` while running, else ``stop``/``length``/``abort``/``error``.
    * ``stop_reason``: the stop token id that ended it (``None`` for EOS or other reasons).
    * ``prompt_logprobs``: when requested (``SamplingParams.prompt_logprobs``), on the output with the first
      token only: one entry per prompt token, ``None`` for the first (nothing predicts it), then
      ``[logprob, [[token_id, logprob], ...top-k]]`` as in ``new_logprobs``.
    * ``num_cached_tokens``: prompt tokens served from the prefix cache (first output only).
    * ``error``: message when ``finish_reason == "error"``; ``error_code``: what kind of failure, when the engine
      knows (``ERROR_STRUCTURED_OUTPUT``: the request's output constraint failed, the client's to fix; ``None``: an
      engine failure).
    * timestamps (Unix seconds): ``queued_ts`` when the engine read it, ``scheduled_ts`` when it was
      first scheduled, ``first_token_ts`` on the output that carries the first token.
    * ``engine_id``: the replica that runs it (lets the api process detect a dead replica).
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    queued_ts: float | None = None
    scheduled_ts: float | None = None
    first_token_ts: float | None = None
    engine_id: str | None = None
    # Optional addition: the pooled vector of a ``pooling`` request, float32 little-endian bytes
    # (``dim × 4`` bytes; ``numpy.frombuffer(pooled, "<f4")``), on its (single, finished) output.
    pooled: bytes | None = None
    error_code: str | None = None


@dataclass
class EngineCoreOutputs:
    """All outputs of one engine step for one api process (one Redis message)."""

    engine_id: str
    timestamp: float
    outputs: list[EngineCoreOutput]

    def to_wire(self) -> bytes:
        """Serialise to msgpack bytes (shallow maps, no ``dataclasses.asdict`` deep copy: this runs once
        per engine step per api process)."""
        data: bytes = msgpack.packb({"engine_id": self.engine_id, "timestamp": self.timestamp,
                                     "outputs": [o.__dict__ for o in self.outputs]}, use_bin_type=True)
        return data

    @classmethod
    def from_wire(cls, data: bytes) -> EngineCoreOutputs:
        """Inverse of ``to_wire``."""
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
        return cls(
            engine_id=raw["engine_id"],
            timestamp=raw["timestamp"],
            outputs=[_output_of(o) for o in raw["outputs"]],
        )


_OUTPUT_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineCoreOutput))


def _output_of(fields: dict[str, Any]) -> EngineCoreOutput:
    """An ``EngineCoreOutput`` from its wire map; fields this version does not know (a newer engine's) are dropped,
    so api processes and engines of neighbouring versions talk during a rolling upgrade."""
    try:
        return EngineCoreOutput(**fields)
    except TypeError:
        return EngineCoreOutput(**{k: v for k, v in fields.items() if k in _OUTPUT_FIELDS})


@dataclass
class EngineStats:
    """A replica's heartbeat payload.

    ``prefill_tokens_per_s``: exponentially averaged prompt tokens per second during prefill
    (admission sizing, docs/ARCHITECTURE.md §3); ``num_running`` / ``num_waiting``: sequences in the batch and
    queued inside the engine; ``num_waiting_tokens``: prompt tokens of the waiting ones; ``max_num_seqs``:
    batch capacity; ``device``: ``cpu`` or ``cuda``. Counters since start: ``prompt_tokens`` (prompt tokens of
    the requests it prefilled) and ``prefix_hit_tokens`` (of those, the ones read from its prefix cache).
    ``host``: the replica's host name, which with ``pid`` names its process (``manage.py serve`` finds its own
    children's heartbeats by it; empty from a replica older than this field).
    """

    engine_id: str
    model: str
    pid: int
    device: str
    max_num_seqs: int
    num_running: int = 0
    num_waiting: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    started_at: float = 0.0
    num_waiting_tokens: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    host: str = ""

    def to_wire(self) -> bytes:
        """Serialise to msgpack bytes."""
        data: bytes = msgpack.packb(dataclasses.asdict(self), use_bin_type=True)
        return data

    @classmethod
    def from_wire(cls, data: bytes) -> EngineStats:
        """Inverse of ``to_wire``; fields this version does not know are ignored (a newer replica's heartbeat)."""
        raw = msgpack.unpackb(data, raw=False)
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})
