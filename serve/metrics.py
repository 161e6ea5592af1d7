"""What ``/metrics`` exposes (Prometheus text): our ``kvshare_*`` names and vLLM's beside them.

Values that only grow are counters and current values gauges, both read from the engine
at scrape time (a custom collector: nothing is copied between the engine thread and the
server); per-request latencies are histograms, observed when a request ends. vLLM's names
(``vllm:num_requests_running``, ``vllm:prefix_cache_hits``, ...) carry its ``model_name``
and ``engine`` labels, so dashboards and routers written for vLLM read a kvshare server
unchanged. ``kvshare_prefix_cache_hit_tokens_total{kv_kind=...}`` says whose KV the prefix
cache served: base KV shared by the base and ICaRus adapters (``shared_base``), base KV an
aLoRA read before its invocation (``alora_pre_invocation``), or KV an adapter owns
(``lora_private``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .cache.host_tier import TierStats
from .cache.layout import KVLayout
from .engine import LLMEngine, RequestOutput

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
    "host_hit_tokens": "prompt tokens served from blocks loaded back from the host tier",
    **{f"host_{f.name}": f"host tier: {f.name.replace('_', ' ')}" for f in fields(TierStats)},
}
KIND_PREFIX = "prefix_hit_tokens_"  # + a KVLayout.reuse_kinds entry: hits by the kind of KV reused
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
    """The engine's statistics at scrape time, as counters and gauges under both names."""

    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine, self.labels = engine, [model_name, "0"]

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        by_kind = CounterMetricFamily("kvshare_prefix_cache_hit_tokens",
                                      "prompt tokens served from the prefix cache, by the kind of KV reused",
                                      labels=["kv_kind"])
        for kind in KVLayout.reuse_kinds:
            by_kind.add_metric([kind], stats.get(KIND_PREFIX + kind, 0))
        yield by_kind
        for key, value in stats.items():
            if key.startswith(KIND_PREFIX):
                continue
            if key in COUNTERS:
                yield CounterMetricFamily(f"kvshare_{key}", COUNTERS[key], value=float(value))
            else:
                yield GaugeMetricFamily(f"kvshare_{key}", f"engine state: {key.replace('_', ' ')}",
                                        value=float(value))
        yield from self._vllm(stats)

    def _vllm(self, stats: dict) -> Iterator[Metric]:
        """vLLM's names for the same values (vllm/v1/metrics/loggers.py)."""
        usage = stats["blocks_in_use"] / stats["blocks_total"] if stats["blocks_total"] else 0.0
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", stats["running"]),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats["waiting"]),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=VLLM_LABELS)
            gauge.add_metric(self.labels, float(value))
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
            counter.add_metric(self.labels, float(stats[key]))
            yield counter
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*VLLM_LABELS, "finished_reason"])
        reasons = dict(self.engine.finish_reasons)  # one C-level copy: the engine thread may add a key
        for reason in dict.fromkeys([*FINISH_REASONS, *reasons]):
            success.add_metric([*self.labels, reason], float(reasons.get(reason, 0)))
        yield success


class ServerMetrics:
    """The server's registry: the engine collector plus per-request histograms."""

    def __init__(self, engine: LLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.ours = {name: Histogram(f"kvshare_request_{name}_seconds", f"per-request {name.replace('_', ' ')}",
                                     registry=self.registry, buckets=OUR_BUCKETS)
                     for name in ("queue_time", "time_to_first_token", "inter_token_latency", "e2e_time")}
        tokens = _one_two_five(engine.max_model_len)

        def vllm(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, VLLM_LABELS, registry=self.registry, buckets=buckets).labels(model_name, "0")

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

    def observe(self, out: RequestOutput) -> None:
        """Record a finished request's latencies and sizes."""
        for name, histogram in self.ours.items():
            value = out.metrics.get(name)
            if value is not None:
                histogram.observe(value)
        for histogram, source in self.vllm:
            value = source(out) if callable(source) else out.metrics.get(source)
            if value is not None:
                histogram.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
