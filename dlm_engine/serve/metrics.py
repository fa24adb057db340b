"""``GET /metrics``: the server's figures in the Prometheus text format (prometheus_client, one registry per
server). Per-sequence figures follow :mod:`dlm_engine.metrics` (NFE, generated tokens, TPF)."""
from __future__ import annotations

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TPF_BUCKETS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0)


class ServeMetrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        disable_created_metrics()      # (no *_created series: creation times are noise on a dashboard)

        r = self.registry = CollectorRegistry()
        self.requests = Counter("dlm_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.queue = Gauge("dlm_queue_depth", "requests waiting for a decode", registry=r)
        self.running = Gauge("dlm_batch_running", "requests in the batch being decoded", registry=r)
        self.batch_size = Histogram("dlm_batch_size", "requests per decoded batch", buckets=BATCH_BUCKETS, registry=r)
        self.tokens = Counter("dlm_generated_tokens", "generated tokens (up to and including EOS)", registry=r)
        self.prompt_tokens = Counter("dlm_prompt_tokens", "prompt tokens of decoded requests", registry=r)
        self.nfe = Counter("dlm_nfe", "sum of per-sequence NFE (forwards each sequence took part in)", registry=r)
        self.model_calls = Counter("dlm_model_calls", "batched forwards (one per step of a batch)", registry=r)
        self.tpf = Histogram("dlm_tpf", "tokens per forward of each sequence", buckets=TPF_BUCKETS, registry=r)
        self.latency = Histogram("dlm_request_latency_seconds", "arrival to answer", buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.queue_wait = Histogram("dlm_queue_wait_seconds", "arrival to the start of its batch's decode",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("dlm_time_to_first_token_seconds", "arrival to the first streamed text",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.decode = Histogram("dlm_batch_decode_seconds", "decode time of a batch", buckets=LATENCY_BUCKETS,
                                registry=r)
        self.freed = Counter("dlm_freed_rows", "rows freed mid-decode (client gone, timed out)", registry=r)
        self.cancelled = Counter("dlm_cancelled_batches", "batches stopped because every request was cancelled",
                                 registry=r)

    # (called from the decode worker and the HTTP side)
    def queue_depth(self, n: int) -> None:
        self.queue.set(n)

    def batch(self, n: int) -> None:
        self.batch_size.observe(n)
        self.running.set(n)

    def decoded(self, model_calls: int, seconds: float) -> None:
        self.model_calls.inc(model_calls)
        self.decode.observe(seconds)
        self.running.set(0)

    def sequence(self, row, prompt_tokens: int) -> None:
        self.tokens.inc(row.generated_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.nfe.inc(row.nfe)
        if row.nfe:
            self.tpf.observe(row.tpf)

    def freed_rows(self, n: int) -> None:
        self.freed.inc(n)

    def cancelled_batch(self) -> None:
        self.cancelled.inc()
        self.running.set(0)

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
