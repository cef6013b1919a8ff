"""``GET /metrics``: Prometheus text format, operator credential (scope ``metrics`` or ``operator``) required.

Every value comes from Redis, so all api processes answer the same numbers (docs/ARCHITECTURE.md §3, §11):

* ``admission_rejections_total{model,reason}`` (counter) — refusals per model and reason;
* ``admission_queued_requests{model}`` / ``admission_queued_prompt_tokens{model}`` (gauges) — live
  admission counters;
* ``admission_max_num_queued_requests{model}`` / ``admission_max_num_queued_tokens{model}`` (gauges, only
  for bounded limits);
* ``engine_prefill_tokens_per_second{model}`` (gauge) — summed measured prefill throughput;
* ``time_to_first_token_seconds{model}`` (histogram) — TTFT of admitted requests, shared across processes
  (bucket counts kept in Redis by ``inference.api.admission``);
* ``request_frontend_time_seconds{model}``, ``request_queue_time_seconds{model}``,
  ``request_prefill_time_seconds{model}`` (histograms) — where that TTFT went: arrival to hand-off to the engine
  (validation, template, tokenization, admission), waiting in a replica's queue, and scheduled to first token
  (vLLM's ``request_queue_time_seconds`` and ``request_prefill_time_seconds``); recorded with TTFT;
* ``admission_tenant_admitted_total{model,tenant}`` / ``admission_tenant_refused_total{model,tenant}``
  (counters) and ``admission_tenant_queued_requests{model,tenant}`` /
  ``admission_tenant_queued_prompt_tokens{model,tenant}`` (gauges) — per tenant (label: the tenant id; at most
  ``inference.api.admission.TENANT_SERIES_MAX`` per model, the rest as ``tenant="other"``);
* ``gateway_handoffs_total{outcome}`` (counter) — image requests the front api relayed to the multimodal api
  (``forwarded``), served itself because that api was down (``fallback``), or lost with it (``failed``):
  gateway/handoff.py;
* ``gateway_auth_refusals_total{reason,key_prefix}`` (counter) — requests refused (401) for their API key:
  ``reason`` among ``revoked``, ``expired``, ``tenant_inactive`` (the key's own secret: ``key_prefix`` is the
  key's prefix), ``unknown_key``, ``wrong_secret``, ``malformed`` (``key_prefix="unknown"``); series are capped
  (gateway/auth.py ``REFUSAL_PREFIX_LABELS_MAX``, then ``key_prefix="other"``);
* ``render_segment_cache_hits_total`` / ``render_segment_cache_misses_total`` (counters) — prompt segments
  whose ids came from / were stored in the segment tokenization cache, summed over the render workers and the
  inline route (``inference.renderer.segment_cache``; Redis hash ``inference.workers.tasks.segment_cache_counter_key``);
  ``render_segment_cache_shared_hits_total``: of the hits, those read from the render workers' shared tier in Redis.
* ``structured_compiles_total{outcome}`` (counter) / ``structured_compile_cpu_seconds_total`` (counter) — output
  constraints (grammars, regexes, schemas) compiled in the api processes' grammar sandboxes: ``ok``, ``invalid``,
  ``budget`` (ended at its CPU-time budget), and the CPU seconds they took (``inference.api.structured_sandbox``);
* ``engine_routed_requests_total{model,engine_id}`` / ``engine_routed_prefix_hit_tokens_total{model,engine_id}``
  (counters) — requests the api processes routed to each replica, and the prompt tokens the router expected
  that replica's prefix cache to serve (``inference/api/router.py``; the replicas ever routed to);
* ``engine_prompt_tokens_total{model,engine_id}`` / ``engine_prefix_cache_hit_tokens_total{model,engine_id}``
  (counters since the replica started) — prompt tokens each live replica prefilled, and of those the ones its
  prefix cache served (the ``cached_tokens`` of usage); ``engine_running_requests{model,engine_id}`` /
  ``engine_waiting_requests{model,engine_id}`` (gauges) — its batch and queue, from its heartbeat.
"""

from __future__ import annotations

import time
from typing import cast

from django.conf import settings
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from collections.abc import Iterator

from prometheus_client.metrics_core import Metric
from redis.asyncio import Redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from gateway import auth, handoff
from gateway.errors import forbidden
from gateway.clients import admission
from gateway.http import GatewayConsumer
from inference.api import admission as adm
from inference.api import structured_sandbox
from inference.workers import tasks as render_tasks
from inference.protocol.engine import EngineStats, live_replica_keys, replicas_index_key, routing_key

METRICS_SCOPES = ("metrics", "operator")


class _Snapshot:
    """A prometheus_client collector yielding families built beforehand (collect() is synchronous)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


# The phases of TTFT (``inference.api.admission.LATENCY_PHASES``, ``output_processor.FirstTokenLatency``): their
# histograms add up, with the engine link's transit, to ``time_to_first_token_seconds``.
PHASE_HELP = {
    "frontend": "Arrival to hand-off to the engine of admitted requests: validation, chat template and "
                "tokenization, admission",
    "queue": "Time admitted requests waited in an engine replica's queue before first scheduled",
    "prefill": "First scheduled on a replica to its first token (prompt prefill, chunks included)",
}


def _cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    """Prometheus histogram buckets (``le`` label, cumulative count) from non-cumulative ``counts`` (one per bound
    plus +Inf)."""
    cumulative, buckets = 0.0, []
    for bound, count in zip(list(bounds) + [float("inf")], counts):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
    return buckets


async def collect_families(redis: Redis, prefix: str) -> list[Metric]:
    """Metric families of every model admission knows, read from Redis (async, a few round trips): admission's
    (``_admission_families``), the gateway's own counters (``_gateway_families``) and the engine replicas'
    (``_replica_families``)."""
    models = sorted(m.decode() if isinstance(m, bytes) else m for m in await redis.smembers(adm.models_key(prefix)))
    return [*await _admission_families(redis, prefix, models), *await _gateway_families(redis, prefix),
            *await _replica_families(redis, prefix, models)]


async def _admission_families(redis: Redis, prefix: str, models: list[str]) -> list[Metric]:
    """Admission's counters, gauges and histograms per model (and per tenant), from its snapshots."""
    rejections = CounterMetricFamily("admission_rejections", "Requests refused by admission control (HTTP 503)",
                                     labels=["model", "reason"])
    q_reqs = GaugeMetricFamily("admission_queued_requests", "Admitted, unfinished requests (n counts n)",
                               labels=["model"])
    q_toks = GaugeMetricFamily("admission_queued_prompt_tokens",
                               "Prompt tokens of admitted requests without a first token yet", labels=["model"])
    lim_reqs = GaugeMetricFamily("admission_max_num_queued_requests", "Published max_num_queued_reqs",
                                 labels=["model"])
    lim_toks = GaugeMetricFamily("admission_max_num_queued_tokens", "Published max_num_queued_tokens",
                                 labels=["model"])
    tps = GaugeMetricFamily("engine_prefill_tokens_per_second", "Measured prefill throughput of live replicas",
                            labels=["model"])
    ttft = HistogramMetricFamily("time_to_first_token_seconds", "Time to first token of admitted requests",
                                 labels=["model"])
    phases = {phase: HistogramMetricFamily(f"request_{phase}_time_seconds", help_text, labels=["model"])
              for phase, help_text in PHASE_HELP.items()}
    t_adm = CounterMetricFamily("admission_tenant_admitted", "Requests admitted by admission control, per tenant",
                                labels=["model", "tenant"])
    t_ref = CounterMetricFamily("admission_tenant_refused", "Requests refused by admission control (503), per tenant",
                                labels=["model", "tenant"])
    t_reqs = GaugeMetricFamily("admission_tenant_queued_requests", "Admitted, unfinished requests, per tenant",
                               labels=["model", "tenant"])
    t_toks = GaugeMetricFamily("admission_tenant_queued_prompt_tokens",
                               "Prompt tokens of admitted requests without a first token yet, per tenant",
                               labels=["model", "tenant"])
    adm_client = admission()
    for model in models:
        snap = await adm_client.snapshot(model)
        for reason in adm.REASONS:
            rejections.add_metric([model, reason], snap["refused"][reason])
        q_reqs.add_metric([model], snap["queued_reqs"])
        q_toks.add_metric([model], snap["queued_tokens"])
        if snap["max_num_queued_reqs"] is not None:
            lim_reqs.add_metric([model], snap["max_num_queued_reqs"])
        if snap["max_num_queued_tokens"] is not None:
            lim_toks.add_metric([model], snap["max_num_queued_tokens"])
        tps.add_metric([model], await adm.prefill_throughput_async(redis, prefix, model))
        ttft.add_metric([model], _cumulative(adm.TTFT_BUCKETS_S, snap["ttft_buckets"]), snap["ttft_sum"])
        for phase, family in phases.items():
            hist = snap["latency"][phase]
            family.add_metric([model], _cumulative(adm.PHASE_BUCKETS_S, hist["buckets"]), hist["sum"])
        for tenant, row in adm.tenant_series(snap["tenants"]):
            t_adm.add_metric([model, tenant], row["admitted"])
            t_ref.add_metric([model, tenant], row["refused"])
            t_reqs.add_metric([model, tenant], row["queued_reqs"])
            t_toks.add_metric([model, tenant], row["queued_tokens"])
    return [rejections, q_reqs, q_toks, lim_reqs, lim_toks, tps, ttft, *phases.values(), t_adm, t_ref, t_reqs, t_toks]


async def _gateway_families(redis: Redis, prefix: str) -> list[Metric]:
    """The api processes' shared counters: image hand-offs, key refusals, grammar compiles, the segment cache."""
    handoffs = CounterMetricFamily("gateway_handoffs", "Image requests handed to the multimodal api, by outcome",
                                   labels=["outcome"])
    counts = await redis.hgetall(handoff.handoff_key(prefix))
    for outcome in handoff.OUTCOMES:
        handoffs.add_metric([outcome], int(counts.get(outcome.encode(), counts.get(outcome, 0))))
    refusals = CounterMetricFamily("gateway_auth_refusals", "Requests refused for their API key (401), by reason "
                                   "and key prefix (revoked, expired or inactive tenant's keys only)",
                                   labels=["reason", "key_prefix"])
    for field, count in sorted((await redis.hgetall(auth.refusals_key(prefix))).items()):
        reason, key_prefix = auth.refusal_labels(field.decode() if isinstance(field, bytes) else field)
        refusals.add_metric([reason, key_prefix], int(count))
    comp = await redis.hgetall(structured_sandbox.counters_key(prefix))
    compiles = CounterMetricFamily("structured_compiles", "Output constraints compiled in the api processes' grammar "
                                   "sandboxes, by outcome (ok, invalid, budget: ended at its CPU-time budget)",
                                   labels=["outcome"])
    for outcome in structured_sandbox.OUTCOMES:
        compiles.add_metric([outcome], int(comp.get(outcome.encode(), comp.get(outcome, 0))))
    compile_cpu = CounterMetricFamily("structured_compile_cpu_seconds", "CPU seconds the grammar sandboxes' compiles "
                                      "took (a compile ended at its budget counts the budget)")
    compile_cpu.add_metric([], float(comp.get(b"cpu_s", comp.get("cpu_s", 0))))
    seg = await redis.hgetall(render_tasks.segment_cache_counter_key(prefix))
    seg_hits = CounterMetricFamily("render_segment_cache_hits", "Prompt segments whose token ids came from the "
                                   "segment tokenization cache (render workers and inline rendering)")
    seg_hits.add_metric([], int(seg.get(b"hits", seg.get("hits", 0))))
    seg_misses = CounterMetricFamily("render_segment_cache_misses", "Prompt segments encoded and then stored in "
                                     "the segment tokenization cache")
    seg_misses.add_metric([], int(seg.get(b"misses", seg.get("misses", 0))))
    seg_shared = CounterMetricFamily("render_segment_cache_shared_hits", "Of the segment cache's hits, those read "
                                     "from the render workers' shared tier in Redis")
    seg_shared.add_metric([], int(seg.get(b"shared_hits", seg.get("shared_hits", 0))))
    return [handoffs, refusals, seg_hits, seg_misses, seg_shared, compiles, compile_cpu]


async def _replica_families(redis: Redis, prefix: str, models: list[str]) -> list[Metric]:
    """Routing counts (``routing_key``) and the live replicas' heartbeat counters and gauges, per model."""
    labels = ["model", "engine_id"]
    routed = CounterMetricFamily("engine_routed_requests", "Requests routed to each engine replica", labels=labels)
    routed_hit = CounterMetricFamily("engine_routed_prefix_hit_tokens", "Prompt tokens the router expected each "
                                     "replica's prefix cache to serve", labels=labels)
    resent = CounterMetricFamily("engine_resent_requests", "Requests waiting on an engine replica when it died, "
                                 "sent again to a live replica", labels=["model"])
    prompt = CounterMetricFamily("engine_prompt_tokens", "Prompt tokens a live replica prefilled since it started",
                                 labels=labels)
    hit = CounterMetricFamily("engine_prefix_cache_hit_tokens", "Prompt tokens a live replica's prefix cache served "
                              "since it started", labels=labels)
    running = GaugeMetricFamily("engine_running_requests", "Requests in a live replica's batch", labels=labels)
    waiting = GaugeMetricFamily("engine_waiting_requests", "Requests waiting inside a live replica", labels=labels)
    now_ms = int(time.time() * 1000)
    for model in models:
        counts = await redis.hgetall(routing_key(prefix, model))
        for raw, value in sorted(counts.items()):
            field = raw.decode() if isinstance(raw, bytes) else raw
            kind, _, engine_id = field.partition(":")
            if kind == "resent":
                resent.add_metric([model], int(value))
            elif kind in ("requests", "hit_tokens"):
                (routed if kind == "requests" else routed_hit).add_metric([model, engine_id], int(value))
        ids = await redis.zrangebyscore(replicas_index_key(prefix, model), now_ms, "+inf")
        for raw_stats in (await redis.mget(live_replica_keys(ids, prefix, model))) if ids else []:
            if not raw_stats:
                continue
            st = EngineStats.from_wire(cast(bytes, raw_stats))  # a bytes-mode pool
            prompt.add_metric([model, st.engine_id], st.prompt_tokens)
            hit.add_metric([model, st.engine_id], st.prefix_hit_tokens)
            running.add_metric([model, st.engine_id], st.num_running)
            waiting.add_metric([model, st.engine_id], st.num_waiting)
    return [routed, routed_hit, resent, prompt, hit, running, waiting]


class MetricsConsumer(GatewayConsumer):
    """Prometheus scrape endpoint (GET)."""

    methods = ("GET",)

    async def handle_request(self, body: bytes) -> None:
        ctx = await auth.authenticate(self.scope["headers"])
        if not any(s in ctx.scopes for s in METRICS_SCOPES):
            raise forbidden("This API key does not have the 'metrics' (or 'operator') scope")
        families = await collect_families(admission().redis, settings.LINK_PREFIX)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot(families))
        text = generate_latest(registry)  # a handful of families: microseconds
        await self.send_headers(status=200, headers=[(b"content-type", CONTENT_TYPE_LATEST.encode())])
        await self.send_body(text)
