"""Prometheus metrics (prometheus-client, one registry per app so several servers can live in one process).

    dsv41_requests_total{endpoint,status}          HTTP API requests by endpoint and status code
    dsv41_request_latency_seconds{endpoint}        end-to-end latency of answered requests
    dsv41_time_to_first_token_seconds              engine arrival -> first token, per sequence
    dsv41_prompt_tokens_total / dsv41_generation_tokens_total
    dsv41_batch_size                               sequences per engine step (histogram)
    dsv41_running_sequences / dsv41_waiting_sequences
    dsv41_finished_sequences_total{reason}         stop / length
    dsv41_aborted_sequences_total                  client went away (slot freed)
    dsv41_preemptions_total                        times finished sequences were preempted (pages freed, recomputed)
    dsv41_prefix_cache_queries_total               prompt tokens looked up in the prefix cache
    dsv41_prefix_cache_hits_total{tier}            prompt tokens served from the cache, by tier
    dsv41_prefix_cache_requests_total{path}        sequences by cache path (cold / swa-hit / replay)
    dsv41_prefix_cache_replays_total               sequences that took Encoder SWA Bounded Replay
    dsv41_kv_bytes_in_use{kind}                    KV bytes held by live sequences (global / swa / pending /
                                                   global_allocated pages)
    dsv41_kv_bytes_peak{kind}                      the highest value of the above since start
    dsv41_prefix_store{name}                       the prefix cache's own counters, when the engine has one
                                                   (`engine.prefix_cache.metrics()`)
    dsv41_speculative_verify_length_total{length}  speculative decoding: row-steps by the verify length chosen
                                                   (0: the step decoded without drafts)
    dsv41_speculative_predicted_tokens_total       tokens predicted per row-step: 1 + the prefix survivals S
                                                   over the verified drafts (1 for a step without drafts)
    dsv41_speculative_realised_tokens_total        tokens those row-steps emitted (predicted / realised over a
                                                   window: the calibration of the confidence head)
    dsv41_speculative_drafted_tokens_total / dsv41_speculative_accepted_tokens_total
    dsv41_speculative_step_predicted_seconds_total decode steps timed against the scheduler's cost model (dspark):
    dsv41_speculative_step_realised_seconds_total  the seconds it predicted for their shapes vs those they took
    dsv41_speculative_timed_steps_total            (predicted / realised: the calibration of T)
"""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

from dsv41.server.protocol import usage_from_stats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

disable_created_metrics()          # no *_created series: they double the exposition and nobody reads them


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()

        def metric(kind, name: str, doc: str, labels=(), **kw):
            return kind(name, doc, labels, registry=r, **kw)
        self.requests = metric(Counter, "dsv41_requests", "HTTP API requests", ["endpoint", "status"])
        self.latency = metric(Histogram, "dsv41_request_latency_seconds", "End-to-end request latency", ["endpoint"],
                              buckets=LATENCY_BUCKETS)
        self.ttft = metric(Histogram, "dsv41_time_to_first_token_seconds", "Engine arrival to first token per "
                           "sequence", buckets=LATENCY_BUCKETS)
        self.prompt_tokens = metric(Counter, "dsv41_prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = metric(Counter, "dsv41_generation_tokens", "Tokens generated")
        self.batch_size = metric(Histogram, "dsv41_batch_size", "Sequences per engine step", buckets=BATCH_BUCKETS)
        self.running = metric(Gauge, "dsv41_running_sequences", "Sequences in the running batch")
        self.waiting = metric(Gauge, "dsv41_waiting_sequences", "Sequences waiting for admission")
        self.finished = metric(Counter, "dsv41_finished_sequences", "Finished sequences by reason", ["reason"])
        self.aborted = metric(Counter, "dsv41_aborted_sequences", "Sequences aborted because their client went away")
        self.preemptions = metric(Counter, "dsv41_preemptions", "Preemptions of finished sequences (their pages "
                                  "freed when the pool ran out, recomputed on resumption)")
        self.cache_queries = metric(Counter, "dsv41_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                    "cache")
        self.cache_hits = metric(Counter, "dsv41_prefix_cache_hits", "Prompt tokens served from the prefix cache by "
                                 "tier", ["tier"])
        self.cache_paths = metric(Counter, "dsv41_prefix_cache_requests", "Sequences by prefix-cache path", ["path"])
        self.replays = metric(Counter, "dsv41_prefix_cache_replays", "Sequences that took Encoder SWA Bounded Replay")
        self.kv_bytes = metric(Gauge, "dsv41_kv_bytes_in_use", "KV bytes held by live sequences", ["kind"])
        self.kv_peak = metric(Gauge, "dsv41_kv_bytes_peak", "Highest KV bytes in use seen since start", ["kind"])
        self.prefix_store = metric(Gauge, "dsv41_prefix_store", "Prefix-cache store counters (the engine's prefix_"
                                   "cache.metrics(): disk and SWA-pool hits, misses, bytes, evictions)", ["name"])
        self.verify_lengths = metric(Counter, "dsv41_speculative_verify_length", "Speculative decoding: row-steps "
                                     "by the verify length chosen (0: decoded without drafts)", ["length"])
        self.spec_predicted = metric(Counter, "dsv41_speculative_predicted_tokens", "Speculative decoding: tokens "
                                     "predicted per row-step (1 + prefix survivals of the verified drafts)")
        self.spec_realised = metric(Counter, "dsv41_speculative_realised_tokens", "Speculative decoding: tokens the "
                                    "row-steps emitted")
        self.spec_drafted = metric(Counter, "dsv41_speculative_drafted_tokens", "Speculative decoding: drafts "
                                   "verified")
        self.spec_accepted = metric(Counter, "dsv41_speculative_accepted_tokens", "Speculative decoding: drafts "
                                    "accepted")
        self.spec_steps = metric(Counter, "dsv41_speculative_timed_steps", "Decode steps timed against the "
                                 "speculative scheduler's cost model T")
        self.spec_step_predicted = metric(Counter, "dsv41_speculative_step_predicted_seconds", "Seconds the cost "
                                          "model T predicted for the timed decode steps' shapes")
        self.spec_step_realised = metric(Counter, "dsv41_speculative_step_realised_seconds", "Seconds the timed "
                                         "decode steps took")
        self._peak: dict[str, int] = {}
        for kind in ("global", "swa", "pending"):
            self.kv_bytes.labels(kind).set(0)
            self.kv_peak.labels(kind).set(0)
        for path in ("cold", "swa-hit", "replay"):
            self.cache_paths.labels(path)

    # called from the HTTP handlers
    def observe_request(self, endpoint: str, status: int, seconds: float | None = None) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        if seconds is not None and status < 400:
            self.latency.labels(endpoint).observe(seconds)

    # called from the engine loop thread
    def observe_step(self, batch: int, step_cost: tuple[float, float] | None = None) -> None:
        """step_cost: the engine's (predicted, realised) seconds of this step (`Engine.last_step_cost`)."""
        if batch:
            self.batch_size.observe(batch)
        if step_cost is not None:
            self.spec_steps.inc()
            self.spec_step_predicted.inc(max(0.0, float(step_cost[0])))
            self.spec_step_realised.inc(max(0.0, float(step_cost[1])))

    def observe_engine(self, running: int, waiting: int, kv: dict[str, int],
                       store: dict[str, float] | None = None) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        for k, v in (store or {}).items():
            self.prefix_store.labels(k).set(v)
        for k, v in kv.items():
            self.kv_bytes.labels(k).set(v)
            if v > self._peak.get(k, -1):
                self._peak[k] = v
                self.kv_peak.labels(k).set(v)

    def observe_completion(self, comp) -> None:
        st = comp.stats
        u = usage_from_stats(st)
        self.prompt_tokens.inc(u["prompt_tokens"])
        self.generation_tokens.inc(u["completion_tokens"])
        if st.get("ttft_s") is not None:
            self.ttft.observe(max(0.0, float(st["ttft_s"])))
        self.finished.labels(str(comp.finish_reason)).inc()
        self.preemptions.inc(int(st.get("preemptions") or 0))
        d = u["prompt_tokens_details"]
        self.cache_queries.inc(u["prompt_tokens"])
        for tier, n in d["cached_tokens_by_tier"].items():
            if n:
                self.cache_hits.labels(tier).inc(n)
        self.cache_paths.labels(d["cache_path"]).inc()
        if d["cache_path"] == "replay":
            self.replays.inc()
        sp = st.get("speculative") or {}
        if sp.get("mode", "off") != "off":
            for v, n in (sp.get("verify_lengths") or {}).items():
                self.verify_lengths.labels(str(v)).inc(n)
            self.spec_predicted.inc(float(sp.get("predicted_tokens") or 0.0))
            self.spec_realised.inc(int(sp.get("realised_tokens") or 0))
            self.spec_drafted.inc(int(sp.get("drafted_tokens") or 0))
            self.spec_accepted.inc(int(sp.get("accepted_tokens") or 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
