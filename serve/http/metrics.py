"""What ``/metrics`` exposes (Prometheus text): our ``kvshare_*`` names and vLLM's beside them.

Values that only grow are counters and current values gauges, both read from the engine
at scrape time (a custom collector: nothing is copied between the engine thread and the
server); per-request latencies are histograms, observed when a request ends. vLLM's names
(``vllm:num_requests_running``, ``vllm:prefix_cache_hits``, ...) carry its ``model_name``
and ``engine`` labels, so dashboards and routers written for vLLM read a kvshare server
unchanged. ``kvshare_prefix_cache_hit_tokens_total{kv_kind=...}`` says whose KV the prefix
cache served: base KV shared by the base and ICaRus adapters (``shared_base``), base KV an
aLoRA read before its invocation (``alora_pre_invocation``), KV an adapter owns
(``lora_private``), the shared base part a ForkKV agent resumed from (``forkkv_base``), or
whole lora K/V reused as it is (``lora_full_reuse``, ``kv_layout="full_reuse"``); the five
add up to ``kvshare_prefix_hit_tokens_total``.

Co-located models (:class:`~kvshare.serve.driver.colocation.Colocation`) share one registry: vLLM's names tell
them apart by ``model_name`` as always, ours gain a ``model_name`` label (one engine keeps
them unlabelled), and ``kvshare:kv_blocks_{owned,lent,borrowed}{model_name=...}`` show each
model's KV blocks: its own, those lent to the others and those borrowed (SwiftCache).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..cache.host_tier import TierStats
from ..driver.colocation import Colocation
from ..engine.llm_engine import LLMEngine, RequestOutput
from ..kv_layout import REUSE_KINDS

# LLMEngine.stats() keys that only grow (Prometheus counters); every other key is a gauge
COUNTERS = {
    "requests": "requests queued",
    "finished": "requests that ended normally (stop or length)",
    "aborted": "requests aborted (client gone or cancelled)",
    "failed": "requests failed by an engine error",
    "prompt_tokens": "prompt tokens of queued requests",
    "generated_tokens": "tokens generated",
    "steps": "engine steps (forward passes)",
    "prefix_queried_tokens": "prompt tokens looked up in the prefix cache",
    "prefix_hit_tokens": "prompt tokens served from the prefix cache",
    "evictions": "cached KV blocks evicted from the device",
    "preemptions": "running requests preempted for room",
    "host_hit_tokens": "prompt tokens served from blocks loaded back from the host tier at the request's "
                       "own demand (a prefetched block's hits count in prefix_hit_tokens only)",
    "admission_holds": "times a new workflow's call was held back (once per step it waited)",
    "forkkv_base_read_tokens": "ForkKV: prompt tokens whose base part was read from the cache",
    "forkkv_residual_hit_tokens": "ForkKV: prompt tokens whose residual was read from the cache",
    "forkkv_residual_evictions": "ForkKV: residual blocks evicted",
    **{f"host_{f.name}": f"host tier: {f.name.replace('_', ' ')}" for f in fields(TierStats)},
}
KIND_PREFIX = "prefix_hit_tokens_"  # + a REUSE_KINDS entry: hits by the kind of KV reused
FINISH_REASONS = ("stop", "length", "abort", "error")  # shown from zero, as vLLM does

# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards' quantiles mean the same here
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
OUR_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
VLLM_LABELS = ("model_name", "engine")


def _one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return buckets
            buckets.append(step * scale)
        scale *= 10


class _EngineCollector:
    """The engines' statistics at scrape time, as counters and gauges under both names.

    One engine keeps our names plain (unlabelled, as dashboards read them); co-located
    engines label every one of ours with ``model_name``. vLLM's always carry it."""

    def __init__(self, colocation: Colocation):
        self.colocation = colocation
        self.by_model = len(colocation.engines) > 1

    def collect(self) -> Iterator[Metric]:
        engines = self.colocation.engines
        stats = {name: engine.stats() for name, engine in engines.items()}
        extra = ["model_name"] if self.by_model else []
        by_kind = CounterMetricFamily("kvshare_prefix_cache_hit_tokens",
                                      "prompt tokens served from the prefix cache, by the kind of KV reused",
                                      labels=[*extra, "kv_kind"])
        ours: dict[str, Metric] = {}
        for name, values in stats.items():
            model = [name] if self.by_model else []
            for kind in REUSE_KINDS:
                by_kind.add_metric([*model, kind], values.get(KIND_PREFIX + kind, 0))
            for key, value in values.items():
                if key.startswith(KIND_PREFIX):
                    continue
                if key not in ours:
                    ours[key] = CounterMetricFamily(f"kvshare_{key}", COUNTERS[key], labels=extra) \
                        if key in COUNTERS else \
                        GaugeMetricFamily(f"kvshare_{key}", f"engine state: {key.replace('_', ' ')}", labels=extra)
                ours[key].add_metric(model, float(value))
        yield by_kind
        yield from ours.values()
        yield from self._vllm(stats)
        yield from self._kv_ownership()

    def _vllm(self, stats: dict[str, dict]) -> Iterator[Metric]:
        """vLLM's names for the same values (vllm/v1/metrics/loggers.py)."""
        gauges = (("vllm:num_requests_running", "Number of requests in model execution batches.",
                   lambda s: s["running"]),
                  ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda s: s["waiting"]),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                   lambda s: s["blocks_in_use"] / s["blocks_total"] if s["blocks_total"] else 0.0))
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=VLLM_LABELS)
            for model, values in stats.items():
                gauge.add_metric([model, "0"], float(value(values)))
            yield gauge
        for name, doc, key in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             "prefix_queried_tokens"),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             "prefix_hit_tokens"),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "preemptions"),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
            ("vllm:generation_tokens", "Number of generation tokens processed.", "generated_tokens"),
        ):
            counter = CounterMetricFamily(name, doc, labels=VLLM_LABELS)
            for model, values in stats.items():
                counter.add_metric([model, "0"], float(values[key]))
            yield counter
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*VLLM_LABELS, "finished_reason"])
        for model, engine in self.colocation.engines.items():
            reasons = dict(engine.finish_reasons)  # one C-level copy: the engine thread may add a key
            for reason in dict.fromkeys([*FINISH_REASONS, *reasons]):
                success.add_metric([model, "0", reason], float(reasons.get(reason, 0)))
        yield success

    def _kv_ownership(self) -> Iterator[Metric]:
        """Per model: KV blocks it owns now, lends to the co-located others, borrows from them
        (SwiftCache; without lending each owns its fixed pool)."""
        stats = self.colocation.stats()
        for what, doc in (("owned", "KV blocks the model's engine may use now"),
                          ("lent", "KV blocks of the model's own share lent to co-located models"),
                          ("borrowed", "KV blocks the model borrows from co-located models")):
            gauge = GaugeMetricFamily(f"kvshare:kv_blocks_{what}", doc, labels=["model_name"])
            for model, values in stats.items():
                gauge.add_metric([model], float(values[f"{what}_blocks"]))
            yield gauge


class ServerMetrics:
    """The server's registry: the engine collector plus per-request histograms."""

    def __init__(self, engine: LLMEngine | Colocation, model_name: str | None = None):
        """Over one engine served as ``model_name``, or over co-located engines (by their
        served names, which label the histograms too)."""
        colocation = Colocation.of(engine, model_name)
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(colocation))
        self.by_model = by_model = len(colocation.engines) > 1
        extra = ("model_name",) if by_model else ()
        models = list(colocation.engines)
        self.ours = {name: Histogram(f"kvshare_request_{name}_seconds", f"per-request {name.replace('_', ' ')}",
                                     extra, registry=self.registry, buckets=OUR_BUCKETS)
                     for name in ("queue_time", "time_to_first_token", "inter_token_latency", "e2e_time")}
        self._default = models[0] if len(models) == 1 else None
        tokens = _one_two_five(max(e.max_model_len for e in colocation.engines.values()))

        def vllm(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, VLLM_LABELS, registry=self.registry, buckets=buckets)

        # (histogram, RequestOutput.metrics key or a function of the output)
        self.vllm = [
            (vllm("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                  TTFT_BUCKETS), "time_to_first_token"),
            (vllm("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds "
                  "(one observation per request: its mean gap between tokens).", TPOT_BUCKETS),
             "inter_token_latency"),
            (vllm("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                  LATENCY_BUCKETS), "e2e_time"),
            (vllm("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                  LATENCY_BUCKETS), "queue_time"),
            (vllm("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens),
             lambda out: len(out.prompt_token_ids)),
            (vllm("vllm:request_generation_tokens", "Number of generation tokens processed.", tokens),
             lambda out: len(out.token_ids)),
        ]
        for histogram, _ in self.vllm:  # every model's series from zero, as with one engine
            for model in models:
                histogram.labels(model, "0")
        if by_model:
            for histogram in self.ours.values():
                for model in models:
                    histogram.labels(model)

    def observe(self, out: RequestOutput, model_name: str | None = None) -> None:
        """Record a finished request's latencies and sizes (``model_name``: its served base,
        needed when several are co-located)."""
        model = model_name or self._default
        if model is None:
            raise ValueError("observe needs the request's model_name when several models are co-located")
        for name, histogram in self.ours.items():
            value = out.metrics.get(name)
            if value is not None:
                (histogram.labels(model) if self.by_model else histogram).observe(value)
        for histogram, source in self.vllm:
            value = source(out) if callable(source) else out.metrics.get(source)
            if value is not None:
                histogram.labels(model, "0").observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
