"""The server's Prometheus metrics (`GET /metrics`), in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

LOAD_GAUGES = ("qwen3vl_requests_waiting", "qwen3vl_requests_running", "qwen3vl_kv_cache_usage_perc")


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("qwen3vl_requests", "Chat completion requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("qwen3vl_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("qwen3vl_generation_tokens", "Tokens generated", registry=r)
        self.waiting = Gauge("qwen3vl_requests_waiting", "Requests queued for the engine", registry=r)
        self.running = Gauge("qwen3vl_requests_running", "Sequences being decoded", registry=r)
        self.ttft = Histogram("qwen3vl_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.per_token = Histogram("qwen3vl_time_per_output_token_seconds", "Between consecutive tokens",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("qwen3vl_decode_batch_size", "Sequences in each decode step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.step_seconds = Histogram("qwen3vl_decode_step_seconds", "Each decode step: one device call for the "
                                      "running sequences and their tokens chosen", buckets=LATENCY_BUCKETS, registry=r)
        self.kv_usage = Gauge("qwen3vl_kv_cache_usage_perc", "Fraction of the KV cache's blocks held by "
                              "sequences (0 to 1; vLLM's kv_cache_usage_perc)", registry=r)
        self.kv_blocks_used = Gauge("qwen3vl_kv_cache_blocks_used", "KV cache blocks held by sequences", registry=r)
        self.kv_blocks_free = Gauge("qwen3vl_kv_cache_blocks_free", "KV cache blocks free (some keep a cached "
                                    "prefix until taken)", registry=r)
        self.prefix_hit_tokens = Counter("qwen3vl_prefix_cache_hit_tokens", "Prompt tokens found in the prefix "
                                         "cache, not prefilled", registry=r)
        self.preemptions = Counter("qwen3vl_preemptions", "Running sequences preempted for blocks (resumed later "
                                   "by prefilling them again)", registry=r)
        self.encoder_hits = Counter("qwen3vl_encoder_cache_hits", "Images/videos served from the encoder cache",
                                    registry=r)
        self.encoder_misses = Counter("qwen3vl_encoder_cache_misses", "Images/videos run through the tower",
                                      registry=r)
        self.encoder_bytes = Gauge("qwen3vl_encoder_cache_bytes", "Bytes held by the encoder cache", registry=r)

    def load(self) -> dict[str, float]:
        """The gauges a router reads of this server (queue, running sequences, KV cache), by
        their /metrics names."""
        return {name: self.registry.get_sample_value(name) for name in LOAD_GAUGES}

    def render(self) -> bytes:
        return generate_latest(self.registry)
