"""Prometheus metrics with vLLM's names under an `llmc:` prefix, each labelled with model_name.

One `CollectorRegistry` per app (no global state). Gauges and the engine's cumulative counters
(preemptions, prefix-cache queries and hits, speculative-decoding tokens) are read from the
engine loop's latest stats snapshot at scrape time; token counters and latency histograms are
fed by the engine thread as outputs are delivered (`on_output`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmc.runtime.outputs import RequestOutput
from llmc.runtime.pooling import PooledRequestOutput
from llmc.runtime.stats import stats_line
from llmc.runtime.server.engine_loop import RequestStream

logger = logging.getLogger("llmc")

# Request latencies span a CPU toy model to a long generation on a busy GPU.
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)

# (metric, help, key of Engine.stats()); counters read cumulative values from the engine.
_GAUGES = (
    ("llmc:num_requests_running", "Sequences running (holding KV blocks).", "num_running"),
    ("llmc:num_requests_waiting", "Sequences waiting for a seat.", "num_waiting"),
    ("llmc:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", "kv_cache_usage"),
)
_COUNTERS = (
    ("llmc:num_preemptions", "Sequences preempted (their KV recomputed) so far.", "num_preemptions"),
    ("llmc:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("llmc:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("llmc:spec_decode_num_draft_tokens", "Draft tokens proposed by speculative decoding.", "num_spec_proposed"),
    ("llmc:spec_decode_num_accepted_tokens", "Draft tokens accepted by speculative decoding.", "num_spec_accepted"),
)


class _EngineStatsCollector:
    def __init__(self, model_name: str, engine_loop):
        self.model_name = model_name
        self.engine_loop = engine_loop

    def collect(self):
        stats = self.engine_loop.stats
        for name, help_text, key in _GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], float(stats.get(key, 0)))
            yield family
        for name, help_text, key in _COUNTERS:
            family = CounterMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], float(stats.get(key, 0)))
            yield family


class ServerMetrics:
    """The app's registry. `on_output` runs on the engine thread (prometheus_client is thread-safe)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name, help_text, extra=()):
            return Counter(name, help_text, labels + list(extra), registry=self.registry)

        def histogram(name, help_text, buckets):
            return Histogram(name, help_text, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.prompt_tokens = counter("llmc:prompt_tokens", "Prompt tokens processed.").labels(model_name)
        self.generation_tokens = counter("llmc:generation_tokens", "Tokens generated.").labels(model_name)
        self.request_success = counter("llmc:request_success", "Requests finished, by finish reason.",
                                       ["finished_reason"])
        for reason in ("stop", "length", "abort"):  # every series from the start, as vLLM's
            self.request_success.labels(model_name, reason)
        self.time_to_first_token = histogram("llmc:time_to_first_token_seconds",
                                             "Arrival to first generated token.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("llmc:inter_token_latency_seconds",
                                             "Time between two outputs of one request.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram("llmc:e2e_request_latency_seconds",
                                             "Arrival to last token.", _REQUEST_BUCKETS)
        self.request_queue_time = histogram("llmc:request_queue_time_seconds",
                                            "Arrival to first scheduled.", _REQUEST_BUCKETS)
        self.num_prompt_tokens = 0  # totals for the periodic log line
        self.num_generation_tokens = 0

    def attach(self, engine_loop) -> None:
        """Export the engine loop's stats snapshot (gauges and engine counters)."""
        self.registry.register(_EngineStatsCollector(self.model_name, engine_loop))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def on_output(self, stream: RequestStream, output: RequestOutput, now: float, step_start: float) -> None:
        if isinstance(output, PooledRequestOutput):  # a prompt, no tokens generated: vLLM counts its prompt
            self.prompt_tokens.inc(output.num_prompt_tokens)
            self.num_prompt_tokens += output.num_prompt_tokens
            self._on_finished(stream, "stop", now)
            return
        num_generated = sum(len(c.token_ids) for c in output.outputs)
        num_new = max(0, num_generated - stream.num_generated_tokens)
        stream.num_generated_tokens = max(num_generated, stream.num_generated_tokens)
        if num_new:
            if stream.first_token_time is None:
                self._on_first_token(stream, output, now, step_start)
            else:
                self.inter_token_latency.observe(now - stream.last_token_time)
            stream.last_token_time = now
            self.generation_tokens.inc(num_new)
            self.num_generation_tokens += num_new
        if output.finished:
            self._on_finished(stream, output.outputs[0].finish_reason if output.outputs else None, now)

    def on_abort(self, stream: RequestStream, now: float) -> None:
        """A request that ended without a finished output (client gone, failed, server stopping): counted
        as vLLM counts its aborted requests, finish reason "abort", with its end-to-end latency."""
        self._on_finished(stream, "abort", now)

    def _on_finished(self, stream: RequestStream, reason: str | None, now: float) -> None:
        self.e2e_request_latency.observe(now - stream.arrival_time)
        self.request_success.labels(self.model_name, reason or "abort").inc()

    def _on_first_token(self, stream: RequestStream, output: RequestOutput, now: float, step_start: float) -> None:
        stream.first_token_time = now
        self.time_to_first_token.observe(now - stream.arrival_time)
        # The engine may report when the request was first scheduled; otherwise the start of the
        # step that produced its first token (exact unless the prefill was split over steps).
        scheduled = output.metrics.get("first_scheduled_time", step_start)
        self.request_queue_time.observe(max(0.0, scheduled - stream.arrival_time))
        self.prompt_tokens.inc(output.num_prompt_tokens)
        self.num_prompt_tokens += output.num_prompt_tokens


async def log_stats_periodically(metrics: ServerMetrics, engine_loop) -> None:
    """Every `log_stats_interval` seconds of the engine's options, one statistics line (the engine's
    format) with the interval's token rates, unless the interval was idle; nothing with disable_log_stats.
    The engines' own step-driven lines are turned off: a line is due by the clock, not by the next step."""
    try:
        await engine_loop.wait_ready()
    except Exception:  # noqa: BLE001 - the startup failure is reported elsewhere
        return
    engines = [replica.engine for replica in engine_loop.replicas]
    options = engines[0].options
    for engine in engines:
        engine.stats_logger.enabled = False
    if options.disable_log_stats:
        return
    interval_s = options.log_stats_interval
    last = (time.monotonic(), metrics.num_prompt_tokens, metrics.num_generation_tokens)
    while True:
        await asyncio.sleep(interval_s)
        now, num_prompt, num_generation = time.monotonic(), metrics.num_prompt_tokens, metrics.num_generation_tokens
        stats = engine_loop.stats
        elapsed = now - last[0]
        is_idle = num_prompt == last[1] and num_generation == last[2] and not stats.get("num_running")
        if not is_idle:
            logger.info(stats_line(stats, (num_prompt - last[1]) / elapsed, (num_generation - last[2]) / elapsed))
        last = (now, num_prompt, num_generation)
