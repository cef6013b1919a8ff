"""EngineCore: the engine replica's loop over the Redis engine link (DESIGN.md §5, §6).

One iteration ("step"):

1. read new ``EngineCoreRequest``s (consumer group ``ENGINE_GROUP`` on ``requests_stream``; XACK once
   accepted; blocking read only when idle) and aborts (``control_stream``, plain XREAD);
2. answer every newly accepted request at once with an empty output (``queued_ts``, ``engine_id``)
   so the api process knows which replica owns it; invalid requests fail here with ``error``;
3. prefill waiting requests that fit (``max_num_seqs``, prefill token budget) in one forward (a prompt
   whose prefix K/V is cached runs on its own from there: ``prefix_cache.py``), and run one decode step
   for the rest of the running batch. Waiting requests go in order of ``priority`` (the caller's tier, set by
   the gateway from the API key: ``inference.admission.engine_priority``), then arrival
   (``enqueue_by_priority``: vLLM's priority scheduling order, without its preemption);
4. sample (batched), apply stop rules, publish one ``EngineCoreOutputs`` message per client_id.

A heartbeat thread SETs ``replica_key`` (``EngineStats``) with a TTL so api processes notice a dead
replica. SIGTERM/SIGINT stop the loop; held requests finish with ``abort`` and an error message, and
the heartbeat key is deleted.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import threading
import time
import uuid
from collections import deque
from typing import TYPE_CHECKING, TypedDict, cast

import msgpack
import redis

from inference.protocol.engine import (
    api_alive_key,
    replicas_index_key,
    ENGINE_GROUP,
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TTL_S,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    unpack_entry,
    EngineStats,
    STRUCTURED_KINDS,
    control_stream,
    outputs_stream,
    replica_key,
    requests_stream,
)
from inference.redis_timeouts import blocking_socket_timeout

from .runner import ModelRunner, RequestError, Sequence, make_rng, now
from .structured import GrammarCompiler, GrammarMask, GrammarMasker, SequenceGrammar

if TYPE_CHECKING:
    import torch

log = logging.getLogger("inference.engine")

OUTPUT_MAXLEN = 10000
EMA_ALPHA = 0.3
CLIENT_CHECK_INTERVAL_S = 2.0  # how often held requests' api processes are checked for liveness
EARLY_ABORT_S = 60.0  # how long an abort for a not-yet-read request is remembered
RECLAIM_IDLE_MS = 2000  # a request entry read but not acknowledged this long belongs to a dead replica
RECLAIM_INTERVAL_S = 1.0
POLL_BLOCK_MS = 100  # an idle replica's XREADGROUP blocks this long; its client waits longer (redis_timeouts.py)
CONSUMER_FORGET_MS = 60_000  # dead replicas' consumers with nothing pending leave the group after this
GRAMMAR_WAIT_S = 0.005  # with nothing to run but requests whose grammar compiles, wait this long for one


# replies of the engine's Redis connection (bytes mode, RESP2): redis-py's types cover every mode and protocol
_StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]
_XReadReply = list[tuple[bytes, _StreamEntries]] | None


class _OutputBase(TypedDict):
    """The fields every output of a just-accepted request carries."""

    request_id: str
    queued_ts: float
    engine_id: str


def enqueue_by_priority(waiting: deque[Sequence], seq: Sequence) -> None:
    """Insert ``seq`` into ``waiting`` ordered by ``(request.priority, request.arrival_time)`` (vLLM's priority
    scheduling order: a lower value first), after any equal key, so requests of one priority (the children of one
    request among them) keep their arrival order. O(1) for the common case (the newcomer goes last)."""
    key = (seq.request.priority, seq.request.arrival_time)
    if not waiting or (waiting[-1].request.priority, waiting[-1].request.arrival_time) <= key:
        waiting.append(seq)
        return
    i = len(waiting)
    while i > 0 and (waiting[i - 1].request.priority, waiting[i - 1].request.arrival_time) > key:
        i -= 1
    waiting.insert(i, seq)


class EngineCore:
    """A replica of one served model: Redis link, scheduler and model runner.

    Args:
        model: served model name (link keys).
        runner: a loaded ``ModelRunner``.
        redis_url: Redis URL of the engine link.
        link_prefix: key prefix (``llmp``).
        engine_id: replica id; random when None.
        max_num_seqs: batch capacity (running sequences).
        max_prefill_tokens: prompt tokens prefilled in one step at most (a single longer prompt
            still runs alone).
    """

    # acceptance outputs (the api learns which replica holds a request) are sent before each step, which may be
    # a long prefill; a subclass whose step is short may let them travel with the step's own outputs
    FLUSH_BEFORE_STEP = True

    def __init__(self, model: str, runner: ModelRunner, redis_url: str, link_prefix: str = "llmp",
                 engine_id: str | None = None, max_num_seqs: int = 32, max_prefill_tokens: int = 4096):
        self.model = model
        self.runner = runner
        self.prefix = link_prefix
        self.engine_id = engine_id or uuid.uuid4().hex[:12]
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=blocking_socket_timeout(POLL_BLOCK_MS / 1000))
        self.hb_redis = redis.Redis.from_url(redis_url)
        self.req_key = requests_stream(link_prefix, model)
        self.ctl_key = control_stream(link_prefix, model)
        self.hb_key = replica_key(link_prefix, model, self.engine_id)
        self.index_key = replicas_index_key(link_prefix, model)
        self.consumer = f"{self.engine_id}-{os.getpid()}"
        self._next_reclaim = 0.0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # same order as the runner's batch rows
        self.stop_event = threading.Event()
        self.stats = EngineStats(engine_id=self.engine_id, model=model, pid=os.getpid(),
                                 device=runner.device.type, max_num_seqs=max_num_seqs,
                                 started_at=time.time())
        self._ctl_last: bytes | str = "$"
        self._pending: dict[str, list[EngineCoreOutput]] = {}
        self._early_aborts: dict[str, float] = {}  # request id -> monotonic time the abort arrived
        self._next_client_check = time.monotonic() + CLIENT_CHECK_INTERVAL_S
        self._grammars: GrammarCompiler | None = None
        self._masker: GrammarMasker | None = None

    # ------------------------------------------------------------------ structured outputs
    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler (``structured.py``), created on first use (its tokenizer builds in its pool)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.runner.model_dir, list(self.runner.eos_token_ids))
        return self._grammars

    @property
    def masker(self) -> GrammarMasker:
        """The per-step mask builder (``structured.py``)."""
        if self._masker is None:
            self._masker = GrammarMasker(self.grammars)
        return self._masker

    def _grammar_of(self, seq: Sequence) -> SequenceGrammar | None:
        """Start compiling ``seq``'s constraint (or take it from the cache); None when it has none. Raises
        ``RequestError`` for an unknown kind."""
        sp = seq.params
        if sp.structured_kind is None:
            return None
        if sp.structured_kind not in STRUCTURED_KINDS:
            raise RequestError(f"unknown structured_kind {sp.structured_kind!r}")
        eos = seq.eos_ids or frozenset(self.runner.eos_token_ids)
        return SequenceGrammar(self.grammars.compile(sp.structured_kind, sp.structured_spec),
                               sp.structured_after_token_ids, eos)

    def _load_grammar_tokenizer(self) -> None:
        """Build the grammar tokenizer before serving: llguidance holds the GIL for part of its ~1-2 s (up to seconds
        on a loaded machine), which would stall the step loop and the heartbeat if it ran later. A failure is
        logged; constrained requests then finish with its error."""
        try:
            _ = self.grammars.tokenizer
        except Exception:  # logged; the engine serves unconstrained requests without it
            log.exception("structured outputs unavailable: the grammar tokenizer did not load")

    def _wait_for_grammars(self) -> None:
        """With nothing running and every waiting request's grammar still compiling, wait a little for one
        (instead of spinning on Redis)."""
        pending = [s.grammar.future for s in self.waiting if s.grammar is not None and not s.grammar.ready()]
        if self.running or len(pending) != len(self.waiting):
            return
        concurrent.futures.wait(pending, timeout=GRAMMAR_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED)

    # ------------------------------------------------------------------ link
    def _setup_link(self) -> None:
        try:
            self.redis.xgroup_create(self.req_key, ENGINE_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        last = cast(_StreamEntries, self.redis.xrevrange(self.ctl_key, count=1))
        self._ctl_last = last[0][0] if last else "0-0"

    def _heartbeat_loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.stats.num_running = len(self.running)
                self.stats.num_waiting = len(self.waiting)
                ttl_ms = int(HEARTBEAT_TTL_S * 1000)
                pipe = self.hb_redis.pipeline(transaction=False)
                pipe.set(self.hb_key, self.stats.to_wire(), px=ttl_ms)
                pipe.zadd(self.index_key, {self.engine_id: int(time.time() * 1000) + ttl_ms})
                pipe.zremrangebyscore(self.index_key, "-inf", int(time.time() * 1000) - 60_000)  # long dead
                pipe.execute()
            except redis.RedisError as exc:  # keep beating; Redis may come back
                log.warning("heartbeat failed: %s", exc)
            self.stop_event.wait(HEARTBEAT_INTERVAL_S)

    def _emit(self, client_id: str, out: EngineCoreOutput) -> None:
        self._pending.setdefault(client_id, []).append(out)

    def _flush(self) -> None:
        if not self._pending:
            return
        pipe = self.redis.pipeline(transaction=False)
        ts = time.time()
        for client_id, outs in self._pending.items():
            msg = EngineCoreOutputs(engine_id=self.engine_id, timestamp=ts, outputs=outs)
            pipe.xadd(outputs_stream(self.prefix, client_id), {"o": msg.to_wire()},
                      maxlen=OUTPUT_MAXLEN, approximate=True)
        # kept until Redis took them: when it is down (a restart) the step loop retries, and the outputs of the
        # steps meanwhile go out together once it is back, so no stream loses its tokens or its end (issue 17's
        # Redis drill; DECISIONS D-183)
        pipe.execute()
        self._pending = {}

    def _poll(self) -> None:
        """Read new requests and aborts; block briefly only when there is nothing to run."""
        idle = not self.running and not self.waiting
        # Take at most what fits soon (2 × max_num_seqs held), leaving the rest to other replicas. The count is
        # of stream entries: an entry holding the n children of one request (``pack_requests``) adds n.
        room = self.max_num_seqs * 2 - len(self.waiting) - len(self.running)
        resp: _XReadReply = None
        if room > 0:
            resp = cast(_XReadReply, self.redis.xreadgroup(ENGINE_GROUP, self.consumer, {self.req_key: ">"},
                                                           count=room, block=POLL_BLOCK_MS if idle else None))
        accepted_ids: list[bytes] = []
        for _stream, entries in resp or []:
            for entry_id, fields in entries:
                accepted_ids.append(entry_id)
                self._accept(fields)
        if room - len(accepted_ids) > 0 and time.monotonic() >= self._next_reclaim:
            accepted_ids += self._reclaim(room - len(accepted_ids))
        # the acknowledgement and the read of aborts share one round trip
        pipe = self.redis.pipeline(transaction=False)
        if accepted_ids:
            pipe.xack(self.req_key, ENGINE_GROUP, *accepted_ids)
            # an accepted entry is never read again (only pending ones are reclaimed): deleted, so the stream holds
            # what is queued, not the last 10,000 requests (Redis memory flat under steady load; DECISIONS D-188)
            pipe.xdel(self.req_key, *accepted_ids)
        pipe.xread({self.ctl_key: self._ctl_last}, count=1000)
        ctl = pipe.execute()[-1]
        for _stream, entries in ctl or []:
            for entry_id, fields in entries:
                self._ctl_last = entry_id
                raw = fields.get(b"a")
                if raw is None:
                    continue
                try:
                    ids = msgpack.unpackb(raw, raw=False)
                except (ValueError, msgpack.UnpackException):
                    continue
                self._abort(set(map(str, ids)))

    def _reclaim(self, count: int) -> list[bytes]:
        """Take over requests another replica read but never acknowledged, i.e. it died between its
        XREADGROUP and XACK (a live replica acknowledges in the same poll, within milliseconds): XAUTOCLAIM
        of entries pending longer than ``RECLAIM_IDLE_MS``, at most every ``RECLAIM_INTERVAL_S``. Without
        this, a request sent as an engine was killed stayed pending for the dead consumer for ever while
        its client waited on a live replica. Also drops dead consumers with nothing pending from the group.
        Returns the entry ids accepted here (the caller acknowledges them)."""
        self._next_reclaim = time.monotonic() + RECLAIM_INTERVAL_S
        resp = self.redis.xautoclaim(self.req_key, ENGINE_GROUP, self.consumer, RECLAIM_IDLE_MS,
                                     start_id="0-0", count=count)
        taken = []
        for entry_id, fields in (resp[1] if resp else []):
            taken.append(entry_id)
            if fields:  # None: the entry was deleted (trimmed) while pending
                log.warning("took over request entry %s left pending by a dead replica", entry_id)
                self._accept(fields)
        for c in self.redis.xinfo_consumers(self.req_key, ENGINE_GROUP):
            name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
            if name != self.consumer and not c["pending"] and c["idle"] > CONSUMER_FORGET_MS:
                self.redis.xgroup_delconsumer(self.req_key, ENGINE_GROUP, name)
        return taken

    def _accept(self, fields: dict[bytes, bytes]) -> None:
        """Accept the request(s) of one stream entry (one request, or the ``n`` children of one)."""
        try:
            requests = unpack_entry(fields)
        except Exception as exc:  # noqa: BLE001 - malformed: nobody to answer to
            log.error("dropping malformed request: %s", exc)
            return
        for req in requests:
            self._accept_one(req)

    def _accept_one(self, req: EngineCoreRequest) -> None:
        seq = Sequence(request=req, queued_ts=now(), rng=make_rng(req.sampling_params.seed))
        base = _OutputBase(request_id=req.request_id, queued_ts=seq.queued_ts, engine_id=self.engine_id)
        try:
            if req.pooling and not hasattr(self.runner, "embed"):
                raise RequestError("this engine serves a generative model; it cannot compute embeddings")
            self.runner.prepare(seq)
            seq.grammar = self._grammar_of(seq)
        except RequestError as exc:
            self._emit(req.client_id, EngineCoreOutput(finish_reason=FINISH_ERROR, error=str(exc), **base))
            return
        except Exception as exc:  # never let one request kill the engine
            log.exception("request %s rejected", req.request_id)
            self._emit(req.client_id, EngineCoreOutput(finish_reason=FINISH_ERROR, error=f"bad request: {exc}",
                                                       **base))
            return
        self._emit(req.client_id, EngineCoreOutput(**base))
        if self._early_aborts.pop(req.request_id, None) is not None:
            self._finish_out(seq, FINISH_ABORT)
            return
        enqueue_by_priority(self.waiting, seq)

    def _abort(self, ids: set[str]) -> None:
        # An abort may overtake its request (still unread in the request stream): remember it a while.
        held = {s.request_id for s in self.waiting} | {s.request_id for s in self.running}
        t = time.monotonic()
        for rid in ids - held:
            self._early_aborts[rid] = t
        if len(self._early_aborts) > 10000 or (self._early_aborts and
                                               t - next(iter(self._early_aborts.values())) > EARLY_ABORT_S):
            self._early_aborts = {k: v for k, v in self._early_aborts.items() if t - v <= EARLY_ABORT_S}
        for seq in [s for s in self.waiting if s.request_id in ids]:
            self.waiting.remove(seq)
            self._finish_out(seq, FINISH_ABORT)
        keep = []
        for i, seq in enumerate(self.running):
            if seq.request_id in ids:
                self._finish_out(seq, FINISH_ABORT)
            else:
                keep.append(i)
        if len(keep) != len(self.running):
            self.runner.remove_rows(keep)
            self.running = [self.running[i] for i in keep]

    def _drop_dead_clients(self) -> None:
        """Abort requests whose api process stopped refreshing its liveness key (killed or restarted),
        so their slots never stay occupied for an output stream nobody reads (DESIGN.md §6)."""
        t = time.monotonic()
        if t < self._next_client_check:
            return
        self._next_client_check = t + CLIENT_CHECK_INTERVAL_S
        clients = sorted({s.request.client_id for s in self.running} | {s.request.client_id for s in self.waiting})
        if not clients:
            return
        alive = self.redis.mget([api_alive_key(self.prefix, c) for c in clients])
        dead = {c for c, v in zip(clients, alive) if v is None}
        if dead:
            ids = {s.request_id for s in list(self.waiting) + self.running if s.request.client_id in dead}
            log.warning("aborting %d request(s) of vanished api process(es) %s", len(ids), sorted(dead))
            self._abort(ids)
            for c in dead:
                self._pending.pop(c, None)

    def _finish_out(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        self._emit(seq.request.client_id, EngineCoreOutput(
            request_id=seq.request_id, finish_reason=reason, error=error, engine_id=self.engine_id))

    # ------------------------------------------------------------------ stepping
    def _check_stop(self, seq: Sequence, token: int) -> None:
        sp = seq.params
        n = len(seq.output_token_ids)
        if n >= sp.min_tokens:
            if not sp.ignore_eos and token in seq.eos_ids:
                seq.finish_reason = FINISH_STOP
                return
            if token in seq.stop_ids:
                seq.finish_reason, seq.stop_reason = FINISH_STOP, token
                return
        if n >= sp.max_tokens or len(seq.request.prompt_token_ids) + n >= self.runner.max_model_len:
            seq.finish_reason = FINISH_LENGTH

    def _mask_ahead(self, seqs: list[Sequence]) -> concurrent.futures.Future[GrammarMask | None] | None:
        """Start computing the grammar mask of ``seqs`` (the rows of the forward about to run) in the masker's
        thread, so that it overlaps the forward (vLLM computes its bitmask while the model runs); None when no row
        is constrained. The matchers' state is that of the mask: nothing advances them until ``_apply``."""
        constrained = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None and s.grammar.constraining]
        if not constrained:
            return None
        return self.masker.submit(constrained, len(seqs), self.runner.vocab_size, self.runner.device)

    def _apply(self, seqs: list[Sequence], logits: torch.Tensor,
               ahead: concurrent.futures.Future[GrammarMask | None] | None = None) -> None:
        """Sample one token per row of ``logits`` ``[len(seqs), vocab]`` under the grammar mask (``ahead``'s, computed
        while the forward ran, or computed now), advance the grammars and emit the tokens."""
        mask = ahead.result() if ahead is not None else None
        if mask is not None and tuple(mask.bias.shape) != tuple(logits.shape):
            mask = None  # computed for another width (not expected: the runner's head is its vocabulary)
        if mask is None:
            constrained = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
            mask = (self.masker.mask(constrained, logits.shape[0], logits.shape[1], logits.device)
                    if constrained else None)
        tokens, lps = self.runner.sample(logits, seqs, mask)
        ts = now()
        for i, (seq, tok) in enumerate(zip(seqs, tokens)):
            seq.output_token_ids.append(tok)
            first = seq.first_token_ts is None
            if first:
                seq.first_token_ts = ts
            self._check_stop(seq, tok)
            if seq.grammar is not None:
                self._advance_grammar(seq, seq.grammar, tok)
            self._emit(seq.request.client_id, EngineCoreOutput(
                request_id=seq.request_id, new_token_ids=[tok],
                new_logprobs=[lps[i]] if lps is not None and lps[i] is not None else None,
                prompt_logprobs=seq.prompt_logprobs if first else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, error=seq.error,
                num_cached_tokens=seq.num_cached_tokens if first else 0,
                scheduled_ts=seq.scheduled_ts if first else None,
                first_token_ts=ts if first else None, engine_id=self.engine_id))

    def _advance_grammar(self, seq: Sequence, grammar: SequenceGrammar, tok: int) -> None:
        """Feed ``tok`` to ``seq``'s matcher. An EOS the grammar allowed ends the output with ``stop`` even under
        ``ignore_eos`` or ``min_tokens`` (the structure is complete; nothing else may follow); a refused token
        (impossible with the mask) finishes the request with an error."""
        try:
            if grammar.advance(tok) and seq.finish_reason in (None, FINISH_LENGTH):
                seq.finish_reason, seq.stop_reason = FINISH_STOP, None
        except Exception as exc:  # one request's grammar must not stop the engine (logged)
            log.exception("grammar of %s failed", seq.request_id)
            seq.finish_reason, seq.error = FINISH_ERROR, f"structured output failed: {exc}"

    def _ema(self, old: float, new: float) -> float:
        return new if old == 0 else (1 - EMA_ALPHA) * old + EMA_ALPHA * new

    def _prefill(self, group: list[Sequence]) -> None:
        """Prefill ``group`` in one runner call, add it to the batch and sample its first tokens; a failed
        forward fails only this group."""
        t0 = time.perf_counter()
        ahead = self._mask_ahead(group)
        try:
            logits = self.runner.prefill(group)
        except Exception as exc:  # fail this group only
            _settle(ahead)
            log.exception("prefill failed")
            # the runner merges only after a successful forward, so the batch is intact
            for s in group:
                self._finish_out(s, FINISH_ERROR, f"prefill failed: {exc}")
            return
        self.running.extend(group)
        dt = time.perf_counter() - t0
        ntok = sum(len(s.request.prompt_token_ids) - s.num_cached_tokens for s in group)
        self.stats.prefill_tokens_per_s = self._ema(self.stats.prefill_tokens_per_s, ntok / max(dt, 1e-9))
        try:
            self._apply(group, logits, ahead)
        except Exception as exc:
            log.exception("sampling failed")
            self._fail_all_running(f"sampling failed: {exc}")

    def step(self) -> None:
        """One engine iteration: prefill what fits, decode the rest, publish outputs."""
        decode_seqs = list(self.running)
        # 1. decode the sequences already in the batch
        if decode_seqs:
            t0 = time.perf_counter()
            ahead = self._mask_ahead(decode_seqs)
            try:
                logits = self.runner.decode(
                    [s.output_token_ids[-1] for s in decode_seqs],
                    [s.num_computed for s in decode_seqs])
                for s in decode_seqs:
                    s.num_computed += 1
                self._apply(decode_seqs, logits, ahead)
            except Exception as exc:
                _settle(ahead)
                log.exception("decode step failed")
                self._fail_all_running(f"engine step failed: {exc}")
                decode_seqs = []
            else:
                dt = time.perf_counter() - t0
                self.stats.decode_tokens_per_s = self._ema(self.stats.decode_tokens_per_s,
                                                           len(decode_seqs) / max(dt, 1e-9))
        # 2. prefill newcomers that fit
        group: list[Sequence] = []
        budget = self.max_prefill_tokens
        compiling: list[Sequence] = []  # requests whose grammar is not compiled yet wait, in order, out of the way
        while self.waiting and len(self.running) + len(group) < self.max_num_seqs:
            head = self.waiting[0]
            if head.grammar is not None:
                if not head.grammar.ready():
                    compiling.append(self.waiting.popleft())
                    continue
                try:
                    head.grammar.start()
                except Exception as exc:  # noqa: BLE001 - a constraint that does not compile fails its request only
                    self.waiting.popleft()
                    self._finish_out(head, FINISH_ERROR, f"structured output constraint {exc}")
                    continue
            n = len(head.request.prompt_token_ids)
            if group and n > budget:
                break
            group.append(self.waiting.popleft())
            budget -= n
        self.waiting.extendleft(reversed(compiling))
        if group:
            ts = now()
            for s in group:
                s.scheduled_ts = ts
            # prompts with a cached prefix run on their own, after the batched ones (prefix_cache.py)
            for sub in self.runner.prefill_groups(group):
                self._prefill(sub)
        # 3. drop finished rows
        keep = [i for i, s in enumerate(self.running) if s.finish_reason is None]
        if len(keep) != len(self.running):
            self.runner.remove_rows(keep)
            self.running = [self.running[i] for i in keep]

    def _fail_all_running(self, message: str) -> None:
        for s in self.running:
            if s.finish_reason is None:
                s.finish_reason = FINISH_ERROR
                self._finish_out(s, FINISH_ERROR, message)
        self.running = []
        self.runner.remove_rows([])

    # ------------------------------------------------------------------ lifecycle
    def request_stop(self, *_args: object) -> None:
        """Signal handler: ask the loop to stop after the current step."""
        self.stop_event.set()

    def run(self) -> None:
        """Run until ``request_stop`` (SIGTERM/SIGINT); then fail held requests and clear the heartbeat."""
        self._setup_link()
        if isinstance(self.runner, ModelRunner):
            self._load_grammar_tokenizer()
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        log.info("engine %s serving %s on %s (max_num_seqs=%d, max_model_len=%d)", self.engine_id,
                 self.model, self.runner.device, self.max_num_seqs, self.runner.max_model_len)
        try:
            while not self.stop_event.is_set():
                try:
                    self._poll()
                    self._drop_dead_clients()
                    if self.FLUSH_BEFORE_STEP:
                        self._flush()  # acceptance outputs go out before the (maybe long) step
                    if self.running or self.waiting:
                        self.step()
                    self._flush()
                    if self.waiting:
                        self._wait_for_grammars()
                except redis.RedisError as exc:
                    log.warning("redis error: %s; retrying", exc)
                    self.stop_event.wait(0.5)
        finally:
            self.stop_event.set()
            hb.join(timeout=2)
            if self._masker is not None:
                self._masker.shutdown()
            if self._grammars is not None:
                self._grammars.shutdown()
            for s in list(self.waiting) + self.running:
                if s.finish_reason is None:
                    self._finish_out(s, FINISH_ABORT, "engine shut down")
            self.waiting.clear()
            self.running = []
            try:
                self._flush()
                self.redis.delete(self.hb_key)
                self.redis.zrem(self.index_key, self.engine_id)
            except redis.RedisError as exc:
                log.warning("cleanup failed: %s", exc)
            log.info("engine %s stopped", self.engine_id)


def _settle(ahead: concurrent.futures.Future[GrammarMask | None] | None) -> None:
    """Wait for a mask computed ahead that a failed step will not use (its matchers stay as they were; a later
    step's advance must not race it), dropping its result or error."""
    if ahead is not None:
        concurrent.futures.wait([ahead])


def install_signal_handlers(core: EngineCore) -> None:
    """Route SIGTERM and SIGINT to ``core.request_stop``."""
    signal.signal(signal.SIGTERM, core.request_stop)
    signal.signal(signal.SIGINT, core.request_stop)
