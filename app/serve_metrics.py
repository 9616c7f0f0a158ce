"""`mmpipe serve`'s Prometheus metrics (`GET /metrics`), in a registry of the app's own (several apps
may live in one process, as in the tests).

What the server sees as choices run (outcomes, tokens, latencies) is counted as it happens, with
the engine's own timings (`RequestMetrics`); what the engine holds (running and waiting requests,
KV pages, graph replays) is read from `Pipeline.stats()` when Prometheus scrapes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmpipe.outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST
ENDPOINTS = ("chat", "completion")
OUTCOMES = ("stop", "length", "abort", "error", "rejected")
RUNNERS = ("decode", "prefill", "vit")
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0)


class ServeMetrics:
    """The server's metrics. `held` reads how many choices the server holds now."""

    def __init__(self, engine: Any, held: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mmpipe_requests", "Choices ended, by endpoint and outcome: stop, length, abort (the client went away "
            "or the server stopped), error, rejected (the server was full: 503). A request with n choices counts "
            "n times; one refused before it had choices (an invalid body) counts once as error.",
            ["endpoint", "outcome"], registry=self.registry)
        for endpoint in ENDPOINTS:  # every series from the start, so that rate() sees the first one
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)
        self.prompt_tokens = Counter(
            "mmpipe_prompt_tokens", "Prompt tokens (image and video tokens included) as usage reports them: "
            "once per prompt, whatever n; counted when the prompt's first token is generated.",
            registry=self.registry)
        self.generation_tokens = Counter(
            "mmpipe_generation_tokens", "Generated tokens, counted as they stream (aborted choices' included).",
            registry=self.registry)
        self.ttft = Histogram(
            "mmpipe_time_to_first_token_seconds", "Seconds from a choice's submission to the engine (template, "
            "media decoding and queueing included) to its first token.", buckets=TTFT_BUCKETS,
            registry=self.registry)
        self.tpot = Histogram(
            "mmpipe_time_per_output_token_seconds", "Per finished choice of two tokens or more: seconds from its "
            "first token to its last, over its tokens after the first.", buckets=TPOT_BUCKETS,
            registry=self.registry)
        self.e2e = Histogram(
            "mmpipe_e2e_request_latency_seconds", "Seconds from a choice's submission to its end (finished "
            "choices: stop or length).", buckets=E2E_BUCKETS, registry=self.registry)
        self.registry.register(EngineCollector(engine, held))

    def choice(self, endpoint: str, counts_prompt: bool) -> ChoiceRecord:
        """The bookkeeping of one choice; `counts_prompt`: it is the first choice of its prompt."""
        return ChoiceRecord(self, endpoint, counts_prompt)

    def count(self, endpoint: str, outcome: str, choices: int = 1) -> None:
        self.requests.labels(endpoint, outcome).inc(choices)

    @contextlib.contextmanager
    def refusals(self, endpoint: str) -> Iterator[None]:
        """Count a request that fails before it has choices (reading and checking its body) as one error."""
        try:
            yield
        except Exception:
            self.count(endpoint, "error")
            raise

    def exposition(self) -> bytes:
        """The text a scrape answers (reads the engine's statistics)."""
        return generate_latest(self.registry)


class ChoiceRecord:
    """One choice's metrics, fed by its events on the event loop: tokens as they arrive, then its end (once)."""

    def __init__(self, metrics: ServeMetrics, endpoint: str, counts_prompt: bool) -> None:
        self.metrics, self.endpoint, self.counts_prompt = metrics, endpoint, counts_prompt
        self.generated = 0  # tokens counted so far
        self.ended = False

    def first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        """The choice's first tokens arrived: its time to first token as the engine measured it (the
        stream's text may have lagged behind its tokens)."""
        if not self.generated:
            self._first(ttft_s, prompt_tokens)

    def tokens(self, generated: int) -> None:
        """`generated` tokens exist now."""
        self._tokens(generated)

    def end(self, outcome: str | None, output: RequestOutput | None = None) -> None:
        """The choice ended with `outcome` (the engine's finish reason, or "error"); `output` is its
        final `RequestOutput` when it ran."""
        if self.ended:
            return
        self.ended = True
        outcome = outcome if outcome in OUTCOMES else "abort"  # None: it never ran to an end
        if output is not None:
            tokens, timings = len(output.token_ids), output.metrics
            if tokens and not self.generated:  # its tokens gave no text (an end-of-sequence token alone)
                self._first(timings.time_to_first_token_s, output.num_prompt_tokens)
            self._tokens(tokens)
            if outcome in ("stop", "length"):
                self.metrics.e2e.observe(timings.total_s)
                if tokens > 1:
                    self.metrics.tpot.observe((timings.total_s - timings.time_to_first_token_s) / (tokens - 1))
        self.metrics.count(self.endpoint, outcome)

    def _first(self, ttft_s: float, prompt_tokens: int) -> None:
        self.metrics.ttft.observe(ttft_s)
        if self.counts_prompt:
            self.metrics.prompt_tokens.inc(prompt_tokens)

    def _tokens(self, generated: int) -> None:
        if generated > self.generated:
            self.metrics.generation_tokens.inc(generated - self.generated)
            self.generated = generated


class EngineCollector(Collector):
    """The engine's state at scrape time, from `Pipeline.stats()` (through the engine process when
    there is one): requests, KV pages, graph runs."""

    def __init__(self, engine: Any, held: Callable[[], int]) -> None:
        self.engine, self.held = engine, held

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.engine.stats()
        except Exception:  # noqa: BLE001 (the pipeline has closed, or its process ended: the server is stopping)
            return
        requests, pages = stats["requests"], stats["kv_pages"]
        yield _gauge("mmpipe_num_requests_running", "Requests in the engine's running batch (prefilling or "
                     "decoding).", requests["running"])
        yield _gauge("mmpipe_num_requests_waiting", "Requests waiting in the engine's queue for a place in the "
                     "batch (KV pages or batch size).", requests["waiting"])
        yield _gauge("mmpipe_num_choices_held", "Choices the server holds: being prepared (template, media), "
                     "waiting or running. Past the batch size plus --max-queued, requests get 503.", self.held())
        yield _gauge("mmpipe_kv_pages_used", "KV cache pages in use.", pages["total"] - pages["free"])
        yield _gauge("mmpipe_kv_pages_total", "KV cache pages in all (each holds page_size tokens).", pages["total"])
        yield _gauge("mmpipe_kv_page_size_tokens", "Tokens a KV cache page holds.", pages["page_size"])
        preemptions = CounterMetricFamily("mmpipe_preemptions", "Running requests preempted for KV pages "
                                          "(recomputed later).", value=requests["preemptions"])
        yield preemptions
        graph = CounterMetricFamily("mmpipe_graph_runs", "Forward calls served by a CUDA graph replay, by runner.",
                                    labels=["runner"])
        eager = CounterMetricFamily("mmpipe_eager_runs", "Forward calls run eagerly (graphs off, no captured size "
                                    "fits, or a capture failed), by runner.", labels=["runner"])
        for runner in RUNNERS:
            runs = stats.get(runner, {})
            graph.add_metric([runner], runs.get("graph_runs", 0))
            eager.add_metric([runner], runs.get("eager_runs", 0))
        yield graph
        yield eager


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
