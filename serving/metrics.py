"""Prometheus metrics with vLLM's names and meanings (prefix `gemma3:` for `vllm:`), every series
labelled with the model and the AllReduce mode so that bf16 and int8 servers share a dashboard.

One registry per server (not the global one), so several apps can live in one process, and no
process-wide setting: the *_created series are left out when this registry is rendered.
"""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

# CONTENT_TYPE_LATEST is re-exported for the app, which need not know the client library.
__all__ = ["CONTENT_TYPE_LATEST", "Metrics", "NullMetrics"]

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0)


class NullMetrics:
    """The observer interface that the engine core and the output processor report to, recording
    nothing (`Metrics` records). Times are in seconds."""

    def on_scheduled(self, queue_time: float) -> None: ...

    def on_prefill(self, prompt_lengths: list[int], seconds: float, bucket: int, batch: int) -> None: ...

    def on_first_token(self, since_arrival: float) -> None: ...

    def on_next_token(self, since_last_token: float) -> None: ...

    def on_finish(self, reason: str, since_arrival: float, since_first_token: float | None) -> None: ...

    def on_state(self, running: int, waiting: int, kv_usage: float) -> None: ...

    def on_decode(self, rows: int, busy: int) -> None: ...

    def on_prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None: ...

    def on_prefix_blocks(self, used: int, capacity: int) -> None: ...


class Metrics(NullMetrics):
    def __init__(self, model_name: str, allreduce: str, tp: int = 1, dtype: str = "",
                 weights: dict | None = None, kv_cache: dict | None = None):
        self.registry = r = CollectorRegistry()
        labels = ("model_name", "allreduce")
        self._values = (model_name, allreduce)

        def series(kind, name, doc, extra=(), **kw):
            """gemma3:`name`, labelled with this server's model and AllReduce; a family left to
            label per observation when it has `extra` labels."""
            metric = kind(f"gemma3:{name}", doc, labels + extra, registry=r, **kw)
            return metric if extra else metric.labels(*self._values)

        def hist(name, doc, buckets=_REQUEST_BUCKETS):
            return series(Histogram, name, doc, buckets=buckets)

        self.running = series(Gauge, "num_requests_running", "Sequences running (holding KV-cache pages).")
        self.waiting = series(Gauge, "num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = series(Gauge, "kv_cache_usage_perc",
                               "Fraction of the KV cache's token positions in use (1 = full).")
        self.prompt_tokens = series(Counter, "prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = series(Counter, "generation_tokens", "Generated tokens.")
        self._success = series(Counter, "request_success",
                               "Finished sequences by finish reason (stop, length, abort, error).",
                               ("finished_reason",))
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens.", _LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.")
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill_time = hist("request_prefill_time_seconds", "Duration of the request's prefill step.")
        self.decode_time = hist("request_decode_time_seconds", "First token to last token.")
        # A step with prompt pieces: its token count and piece count (the step is padded to a
        # compiled bucket of both).
        self._prefill_steps = series(Counter, "prefill_steps",
                                     "Prompt pieces by the token count and piece count of their step.", ("bucket", "batch"))
        self._prefill_padding = series(Counter, "prefill_padding_tokens",
                                       "Token positions computed by prefill beyond the prompts.")
        # A step with decode rows: its row count, and rows of sequences that ended meanwhile.
        self._decode_steps = series(Counter, "decode_steps", "Steps with decode rows, by row count.",
                                    ("rows",))
        self._decode_padding = series(Counter, "decode_padding_rows",
                                      "Rows computed by steps for sequences that had ended or no token.")
        # vLLM's prefix-cache counters: prompt tokens looked up, and those found in the cache.
        self.prefix_queries = series(Counter, "prefix_cache_queries",
                                     "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = series(Counter, "prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache (not prefilled).")
        self.prefix_blocks = series(Gauge, "prefix_cache_blocks",
                                    "KV-cache pages held for prefix reuse (each one page of a prompt).")
        self.prefix_capacity = series(Gauge, "prefix_cache_capacity_blocks",
                                      "KV-cache pages that prefix reuse may hold (0: no prefix cache).")
        info = series(Gauge, "engine_info", "Engine configuration (value 1).", ("tp", "dtype"))
        info.labels(*self._values, str(tp), dtype).set(1)
        if weights:
            series(Gauge, "weights_bytes", "Bytes of the model's weights on the devices (one copy, "
                   "quantization scales included), "
                   "by the linear layers' dtype, the quantization and its group size (0: a "
                   "scale per channel).", ("dtype", "quantization", "group_size")
                   ).labels(*self._values, weights["dtype"], weights["quantization"],
                            str(weights["group_size"])).set(weights["bytes"])
        if kv_cache:
            series(Gauge, "kv_cache_bytes", "Bytes of the KV cache's pools on all devices (codes "
                   "and scales), by what they hold (--kv-cache-dtype).", ("kv_cache_dtype",)
                   ).labels(*self._values, kv_cache["dtype"]).set(kv_cache["bytes"])

    def on_scheduled(self, queue_time: float) -> None:
        self.queue_time.observe(queue_time)

    def on_prefill(self, prompt_lengths: list[int], seconds: float, bucket: int, batch: int) -> None:
        for n in prompt_lengths:
            self.prefill_time.observe(seconds)
            self.prompt_tokens.inc(n)
        self._prefill_steps.labels(*self._values, str(bucket), str(batch)).inc()
        self._prefill_padding.inc(bucket * batch - sum(prompt_lengths))

    def on_first_token(self, since_arrival: float) -> None:
        self.generation_tokens.inc()
        self.ttft.observe(since_arrival)

    def on_next_token(self, since_last_token: float) -> None:
        self.generation_tokens.inc()
        self.itl.observe(since_last_token)

    def on_finish(self, reason: str, since_arrival: float, since_first_token: float | None) -> None:
        self._success.labels(*self._values, reason).inc()
        if reason in ("stop", "length"):
            self.e2e.observe(since_arrival)
            if since_first_token is not None:
                self.decode_time.observe(since_first_token)

    def on_state(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    def on_decode(self, rows: int, busy: int) -> None:
        self._decode_steps.labels(*self._values, str(rows)).inc()
        self._decode_padding.inc(rows - busy)

    def on_prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries.inc(queried_tokens)
        self.prefix_hits.inc(hit_tokens)

    def on_prefix_blocks(self, used: int, capacity: int) -> None:
        self.prefix_blocks.set(used)
        self.prefix_capacity.set(capacity)

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """A registry's series less the *_created ones, which double the output and which no
    dashboard uses (vLLM leaves them out too). prometheus_client's own switch for this,
    `disable_created_metrics`, is process-wide."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self):
        for metric in self._registry.collect():  # fresh objects on every collect
            metric.samples = [s for s in metric.samples if s.name != metric.name + "_created"]
            yield metric
