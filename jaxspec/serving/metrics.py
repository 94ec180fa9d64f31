"""Prometheus metrics of one server (its own registry: nothing module-global).

What they mean (also in docs/serving.md's metrics table):
- `jaxspec_generated_tokens_total`: tokens handed to clients; `jaxspec_tokens_per_second`: that rate over the last
  `window` seconds.
- `jaxspec_draft_reached_total{position=j}` / `jaxspec_draft_accepted_total{position=j}`: how often draft position j
  was verified (every earlier one accepted) and accepted; `jaxspec_draft_acceptance_rate{position=j}` is their ratio,
  the conditional acceptance a_j of the cost model.
- `jaxspec_mean_accepted_length`: tokens a generating row gains per cycle (accepted drafts + the bonus token), since
  start; `jaxspec_row_cycles_total` (one per generating row per cycle) and `jaxspec_cycles_total` give it over any
  window, and their ratio is the mean batch occupancy during cycles.
- `jaxspec_queue_depth`: requests waiting for a slot; `jaxspec_batch_occupancy`: slots holding a request (of
  `jaxspec_slots`).
- `jaxspec_time_to_first_token_seconds`: arrival to the first token handed out; `jaxspec_inter_token_latency_seconds`:
  the gap between tokens of one request (tokens arriving together share the gap since the previous arrival).
- `jaxspec_requests_total{finish_reason}`: finished requests by reason (stop, length, cancelled, error).
- `jaxspec_segments_total{draft}`: segments run per draft shape (`k=0` plain decoding, `k=3` a chain; with
  `--num-steps auto` the shape changes per segment); `jaxspec_segment_predicted_tokens_per_second` and
  `jaxspec_segment_measured_tokens_per_second`: the last segment's throughput as the scheduler's cost model predicted
  it when choosing the shape (absent until that shape was timed at that batch bucket) and as it ran.
- `jaxspec_prefill_chunks_total{drafter}`: prompt chunks prefilled, `fed` the drafter too or `not fed` (with
  `--num-steps auto`, rows admitted while speculation does not pay: the drafter does not run at prefill, and a
  chain that later runs on the row drafts from the prompt's last position on).
- The cache pool (as vLLM's `kv_cache_usage_perc`, `num_preemptions`, `prefix_cache_queries` / `_hits`):
  `jaxspec_kv_cache_usage_perc`: the fraction of the pool's blocks rows hold (of `jaxspec_kv_cache_blocks`);
  `jaxspec_num_preemptions_total`: rows preempted because the pool ran out (resumed later by recompute);
  `jaxspec_prefix_cache_queries_total` / `jaxspec_prefix_cache_hits_total`: prompt tokens looked up in the prefix
  cache, and those found there (their ratio is the hit rate).
"""

from __future__ import annotations

import collections
import time

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxspec.decoding.draft_shape import DraftShape

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """The server's metrics; `render()` is the /metrics body."""

    def __init__(self, draft: DraftShape, slots: int, *, window: float = 10.0, pool_blocks: int = 0):
        """`draft`: what every cycle drafts; `slots`: the compiled batch; `pool_blocks`: the cache pool's blocks."""
        num_steps = draft.num_steps
        self.registry = r = CollectorRegistry()
        self.window = window
        self.tokens = Counter("jaxspec_generated_tokens", "Tokens generated and handed to clients", registry=r)
        self.tokens_per_second = Gauge(
            "jaxspec_tokens_per_second", f"Generated tokens per second over the last {window:g}s", registry=r
        )
        self.cycles = Counter("jaxspec_cycles", "Draft-verify cycles run", registry=r)
        self.row_cycles = Counter("jaxspec_row_cycles", "Cycles x rows generating in them", registry=r)
        self.reached = Counter(
            "jaxspec_draft_reached", "Draft position (a tree's depth) verified", ["position"], registry=r
        )
        self.accepted = Counter(
            "jaxspec_draft_accepted", "Draft position (a tree's depth) accepted", ["position"], registry=r
        )
        self.rate = Gauge("jaxspec_draft_acceptance_rate", "accepted / reached", ["position"], registry=r)
        self.mean_accepted_length = Gauge(
            "jaxspec_mean_accepted_length", "Tokens per generating row per cycle (accepted drafts + bonus)", registry=r
        )
        self.queue_depth = Gauge("jaxspec_queue_depth", "Requests waiting for a slot", registry=r)
        self.occupancy = Gauge("jaxspec_batch_occupancy", "Slots holding a request", registry=r)
        Gauge("jaxspec_slots", "Slots (the compiled batch)", registry=r).set(slots)
        Gauge("jaxspec_num_steps", "Draft tokens per cycle (k; a tree's depth)", registry=r).set(num_steps)
        Gauge("jaxspec_topk", "Children per frontier node (1 = chain drafts)", registry=r).set(draft.topk)
        Gauge("jaxspec_verify_tokens", "Tokens one verify step takes (chain: k+1; tree: its nodes)", registry=r).set(
            draft.verify_tokens
        )
        self.ttft = Histogram(
            "jaxspec_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "jaxspec_inter_token_latency_seconds", "Gap between tokens", buckets=LATENCY_BUCKETS, registry=r
        )
        self.requests = Counter("jaxspec_requests", "Finished requests", ["finish_reason"], registry=r)
        self.segments = Counter("jaxspec_segments", "Segments run, by draft shape", ["draft"], registry=r)
        self.predicted = Gauge(
            "jaxspec_segment_predicted_tokens_per_second", "The last segment's predicted tokens/s", registry=r
        )
        self.measured = Gauge("jaxspec_segment_measured_tokens_per_second", "The last segment's tokens/s", registry=r)
        self.prefill_chunks = Counter(
            "jaxspec_prefill_chunks",
            "Prompt chunks prefilled, by whether the drafter ran over them",
            ["drafter"],
            registry=r,
        )
        Gauge("jaxspec_kv_cache_blocks", "Blocks of the cache pool", registry=r).set(pool_blocks)
        self.kv_cache_usage = Gauge("jaxspec_kv_cache_usage_perc", "Fraction of the pool's blocks held", registry=r)
        self.preemptions = Counter("jaxspec_num_preemptions", "Rows preempted: the cache pool ran out", registry=r)
        self.prefix_queries = Counter(
            "jaxspec_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter("jaxspec_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.num_steps = num_steps
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._totals = np.zeros(2)  # row cycles, accepted drafts since start
        self._per_position = np.zeros((2, num_steps))  # reached, accepted since start

    def observe_cycles(self, cycles, reached_J, accepted_J, hist_T) -> None:
        """Counter deltas of one engine step (from the loop state's counters)."""
        self.cycles.inc(int(cycles))
        row_cycles = int(np.sum(hist_T))
        self.row_cycles.inc(row_cycles)
        self._per_position += (reached_J, accepted_J)
        for j in range(self.num_steps):
            self.reached.labels(str(j + 1)).inc(int(reached_J[j]))
            self.accepted.labels(str(j + 1)).inc(int(accepted_J[j]))
            self.rate.labels(str(j + 1)).set(self._per_position[1, j] / max(self._per_position[0, j], 1))
        self._totals += (row_cycles, float(np.dot(hist_T, np.arange(len(hist_T)))))
        if self._totals[0]:
            self.mean_accepted_length.set(1 + self._totals[1] / self._totals[0])

    def observe_segment(self, draft: str, predicted: float | None, measured: float | None) -> None:
        """One segment: its draft shape's label, its predicted tokens/s (None: not predicted) and measured tokens/s
        (None: not timed, its program ran prefill chunks too)."""
        self.segments.labels(draft).inc()
        if predicted is not None:
            self.predicted.set(predicted)
        if measured is not None:
            self.measured.set(measured)

    def observe_tokens(self, n: int) -> None:
        now = time.perf_counter()
        self.tokens.inc(n)
        self._recent.append((now, n))
        while self._recent and self._recent[0][0] < now - self.window:
            self._recent.popleft()
        self.tokens_per_second.set(sum(k for _, k in self._recent) / self.window)

    def render(self) -> bytes:
        return generate_latest(self.registry)
