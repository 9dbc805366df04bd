"""The ingress's Prometheus metrics (its own registry) plus the engine's figures, fetched per scrape. A scraper
that accepts OpenMetrics gets that format, whose exemplars name the request id of a latency sample (the
time to first token and the end-to-end latency)."""

from typing import Optional


class ServeMetrics:
    """The ingress's Prometheus metrics (its own registry) plus the engine's figures, fetched per scrape."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("dsquant_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=self.registry)
        self.prompt_tokens = Counter("dsquant_prompt_tokens", "prompt tokens of accepted requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("dsquant_generation_tokens", "tokens generated and sent",
                                         registry=self.registry)
        self.finished = Counter("dsquant_requests_finished", "generation requests by finish reason",
                                ["reason"], registry=self.registry)
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("dsquant_time_to_first_token_seconds", "time from request to first token",
                              buckets=lat, registry=self.registry)
        self.itl = Histogram("dsquant_inter_token_latency_seconds", "gap between consecutive token events",
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
                             registry=self.registry)
        self.e2e = Histogram("dsquant_e2e_request_latency_seconds", "time from request to last token",
                             buckets=lat, registry=self.registry)
        self.in_flight = Gauge("dsquant_requests_in_flight", "generation requests in flight on this ingress",
                               registry=self.registry)
        self.engine: dict = {}
        self.registry.register(_EngineCollector(self))

    def render(self, engine_stats: Optional[dict], accept: str = "") -> tuple[bytes, str]:
        """(the exposition, its content type): OpenMetrics (with exemplars) when ``accept`` (the scrape's
        Accept header) takes it, else Prometheus's text format."""
        self.engine = engine_stats or {}
        if "application/openmetrics-text" in accept:
            from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST, generate_latest
        else:
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    """The engine replica's snapshot as gauges and counters."""

    GAUGES = {"running": "sequences running in the engine", "waiting": "sequences waiting in the engine",
              "cache_blocks_used": "KV cache blocks in use", "cache_blocks_free": "KV cache blocks free",
              "cache_blocks_total": "KV cache blocks in all"}
    COUNTERS = {"aborted": "sequences aborted (client gone)", "preemptions": "sequences preempted",
                "steps": "engine steps", "mtp_drafts": "MTP draft tokens proposed",
                "mtp_accepted": "MTP draft tokens accepted",
                "kv_handoffs": "prompts prefilled by the prefill deployment and decoded here",
                "kv_handoff_bytes": "bytes of KV cache blocks received from prefill",
                "prefill_failures": "requests failed at prefill (unavailable, timed out)"}
    # prefix caching: dsquant_prefix_cache_<key>, <key> of the snapshot's prefix_cache_<key>
    PREFIX_GAUGES = {"hit_rate": "prompt tokens found in the prefix cache / prompt tokens looked up",
                     "blocks": "KV cache blocks holding a prefix-cache entry (in use or evictable)"}
    PREFIX_COUNTERS = {"queries": "prompt tokens looked up in the prefix cache at admission",
                       "hits": "prompt tokens found in the prefix cache (their prefill skipped)",
                       "recompute_hits": "tokens a preempted sequence found in the prefix cache when recomputed"}

    def __init__(self, metrics: ServeMetrics):
        self.metrics = metrics

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.metrics.engine
        yield GaugeMetricFamily("dsquant_engine_up", "1 when the engine answered this scrape and its loop runs",
                                value=1.0 if s.get("alive") else 0.0)
        for k, doc in self.GAUGES.items():
            if k in s:
                yield GaugeMetricFamily(f"dsquant_engine_{k}", doc, value=float(s[k]))
        for k, doc in self.COUNTERS.items():
            if k in s:
                yield CounterMetricFamily(f"dsquant_engine_{k}", doc, value=float(s[k]))
        for kinds, family in ((self.PREFIX_GAUGES, GaugeMetricFamily), (self.PREFIX_COUNTERS, CounterMetricFamily)):
            for k, doc in kinds.items():
                if f"prefix_cache_{k}" in s:
                    yield family(f"dsquant_prefix_cache_{k}", doc, value=float(s[f"prefix_cache_{k}"]))
        if s.get("kernels"):
            labels = sorted(s["kernels"])
            info = GaugeMetricFamily("dsquant_engine_kernels", "1: the kernels the engine was built with (its device, "
                                     "backend, and the int8 linears', float ops' and decode attention's)",
                                     labels=labels)
            info.add_metric([str(s["kernels"][k]) for k in labels], 1.0)
            yield info
