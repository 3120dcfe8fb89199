"""The server's Prometheus metrics, under vLLM's names so that dashboards made for vLLM read them.

Gauges and the engine's own counters are read from the engine loop at each
scrape; latencies and token counts are observed by the server as requests run.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.loop import EngineLoop

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class _EngineCollector:
    """What the engine loop knows at scrape time: requests running and waiting, K/V use, cache hits, preemptions,
    speculative decoding's drafts."""

    def __init__(self, loop: EngineLoop, model_name: str):
        self.loop = loop
        self.model_name = model_name

    def collect(self):
        stats, labels = self.loop.stats, [self.model_name]
        running = stats.get("running", 0)
        values = [
            (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the engine's running batch", running),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to run", self.loop.num_waiting()),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Fraction of the KV cache budget's blocks in use (0 to 1)",
             stats.get("used_blocks", 0) / max(1, stats.get("max_blocks", 1))),
            (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             stats.get("prefix_cache_query_tokens", 0)),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (memory and disk)",
             stats.get("prefix_cache_hit_tokens", 0)),
            (CounterMetricFamily, "vllm:num_preemptions", "Requests preempted to free KV blocks", stats.get("preemptions", 0)),
            (CounterMetricFamily, "vllm:spec_decode_num_drafts", "Drafts verified (speculative decoding)",
             stats.get("drafts", 0)),
            (CounterMetricFamily, "vllm:spec_decode_num_draft_tokens", "Tokens drafted", stats.get("draft_tokens", 0)),
            (CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted",
             stats.get("accepted_draft_tokens", 0)),
        ]
        for family, name, documentation, value in values:
            metric = family(name, documentation, labels=["model_name"])
            metric.add_metric(labels, value)
            yield metric


class ServerMetrics:
    def __init__(self, loop: EngineLoop, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(loop, model_name))
        common = {"labelnames": ["model_name"], "registry": self.registry}
        # This model's series, looked up once: the server records some for every token.
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              **common).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens", buckets=LATENCY_BUCKETS,
                             **common).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency", buckets=REQUEST_BUCKETS,
                             **common).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests", **common).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", **common).labels(model_name)
        self.success = Counter(
            "vllm:request_success", "Finished requests by finish reason",
            labelnames=["model_name", "finished_reason"], registry=self.registry,
        )

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def next_token(self, seconds: float, tokens: int) -> None:
        """A chunk of ``tokens`` tokens came ``seconds`` after the previous one."""
        for _ in range(tokens):
            self.itl.observe(seconds / tokens)

    def finished(self, seconds: float, prompt_tokens: int, generated: int, reason: str) -> None:
        self.e2e.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
