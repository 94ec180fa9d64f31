"""The serving engine: continuous batching over a fixed set of slots, the batch B of one compiled draft-verify loop.

An engine step is three calls: the scheduler decides (`Scheduler.schedule() -> StepPlan`, plain Python), the executor
runs the plan on the device (`Executor.run(plan) -> StepResult`), and the scheduler hands the result to the requests
(`Scheduler.update(result)`). See scheduler.py for what a step decides and plan.py for what the device does. The
engine adds the thread that drives the steps, the warm-up that compiles every program, and the metrics.

Every program has fixed shapes (B slots, S context positions, C prefill chunk, the compiled row and context
buckets), so nothing recompiles after warm-up. Sampling settings, seeds and stop ids are per-row arrays, so greedy
and sampled requests share a batch; each row draws from its own key, so a request's output never depends on what
else is in the batch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxspec.decoding.draft_shape import DraftShape
from jaxspec.decoding.sampling_params import RowSpec, Sampling
from jaxspec.serving import fanout
from jaxspec.serving.adaptive import Calibration, DraftPolicy, measured_tokens_per_second
from jaxspec.serving.executor import Executor
from jaxspec.serving.plan import RowAdmission, Segment, StepPlan, StepResult
from jaxspec.serving.scheduler import QueueFull, Request, Scheduler, StepReport
from jaxspec.serving.startup import MapBudget, Programs, StartupError, maps_in_use
from sharding.mesh import platform_of

__all__ = ["Engine", "EngineConfig", "QueueFull", "Request", "StartupError"]
log = logging.getLogger("jaxspec.serving")


def _setting(default: Any, help: str) -> Any:
    """An EngineConfig field: its default and the help of its `jaxspec serve` flag (--<field-name>, generated from
    these fields: cli/serve.py)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static shape of the engine: each field is part of the compiled programs. The fields with a help text are the
    flags of `jaxspec serve`; `draft` comes from its --num-steps, --topk and --num-draft-tokens."""

    max_batch: int = _setting(8, "slots: the batch of the compiled loop")
    max_context: int = _setting(
        1024, "positions per slot: prompt + max_tokens + the draft's lookahead + 1 (k + 2 for a chain of k)"
    )
    draft: DraftShape = DraftShape(3)  # what every cycle drafts (DraftShape(0): plain decoding); adaptive: the deepest
    # Per segment, plain decoding or `draft` (a chain or a tree), whichever the scheduler's DraftPolicy predicts faster
    # for the rows generating then (`jaxspec serve --num-steps auto`, with --topk: a tree); both compile, and run on
    # one loop state.
    adaptive: bool = False
    prefill_chunk: int = _setting(64, "prompt tokens per prefill call")
    segment_cycles: int = _setting(4, "cycles per segment (admission and streaming happen between segments)")
    max_queue: int = _setting(64, "requests waiting for a slot before new ones get 429")
    # A segment runs only rows [0, b) for the smallest b covering every generating row (free slots are taken lowest
    # first), so one request does not pay for B rows.
    batch_buckets: tuple[int, ...] = _setting(
        (), "comma-separated segment batch sizes to compile (default: powers of two up to --max-batch)"
    )
    # While every occupied row is greedy, segments run the static-greedy program (argmax head, no per-row warping
    # or sampling); its tokens are the per-row program's for greedy rows. False: always the per-row program.
    greedy_program: bool = True
    # The cache pool (blocks.py): every slot's target and drafter cache positions live in blocks of it, so requests
    # share one budget of positions instead of each slot owning max_context of them, and share cached prefixes.
    kv_cache_tokens: int = _setting(0, "cache positions in the shared pool (0: max-batch x max-context)")
    block_size: int = _setting(
        0, "positions per cache block (0: the largest dividing the prefill chunk and the max context)"
    )
    prefix_cache: bool = _setting(True, "reuse the cache of full prompt blocks another request already computed")

    @property
    def block(self) -> int:
        """Positions per cache block (`block_size`, or its default)."""
        return self.block_size or math.gcd(self.prefill_chunk, self.max_context)

    @property
    def pool_blocks(self) -> int:
        """Blocks in the cache pool (the null block aside)."""
        return (self.kv_cache_tokens or self.max_batch * self.max_context) // self.block

    @property
    def buckets(self) -> tuple[int, ...]:
        if self.batch_buckets:
            return tuple(sorted(set(self.batch_buckets) | {self.max_batch}))
        return tuple(sorted({min(1 << i, self.max_batch) for i in range(self.max_batch.bit_length() + 1)}))

    @property
    def shapes(self) -> tuple[DraftShape, ...]:
        """The draft shapes segments run (compiled each)."""
        return (DraftShape(0), self.draft) if self.adaptive and not self.draft.plain else (self.draft,)

    def __post_init__(self):
        for name in ("max_batch", "max_context", "prefill_chunk", "segment_cycles"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name}: expected an integer >= 1, got {value!r}")
        if not isinstance(self.draft, DraftShape):
            raise ValueError(f"EngineConfig.draft: expected a DraftShape, got {self.draft!r}")
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ValueError(f"EngineConfig.max_queue: expected an integer >= 0, got {self.max_queue!r}")
        if any(not isinstance(b, int) or not 1 <= b <= self.max_batch for b in self.batch_buckets):
            raise ValueError(
                f"EngineConfig.batch_buckets: expected sizes in [1, {self.max_batch}], got {self.batch_buckets}"
            )
        self._check_pool()
        if self.max_context % self.prefill_chunk:
            raise ValueError(
                f"EngineConfig.max_context ({self.max_context}) must be a multiple of prefill_chunk "
                f"({self.prefill_chunk})"
            )

    def _check_pool(self) -> None:
        for name in ("kv_cache_tokens", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"EngineConfig.{name}: expected an integer >= 0, got {value!r}")
        if any(n % self.block for n in (self.prefill_chunk, self.max_context)):
            raise ValueError(
                f"EngineConfig.block_size: {self.block} must divide the prefill chunk ({self.prefill_chunk}) and "
                f"max_context ({self.max_context})"
            )
        if self.kv_cache_tokens and self.kv_cache_tokens < self.max_context:
            raise ValueError(
                f"EngineConfig.kv_cache_tokens: expected at least max_context ({self.max_context}), "
                f"got {self.kv_cache_tokens}"
            )


class Engine:
    """Continuous batching with speculative decoding. Drive it with `start()` (a background thread) or call `step()`
    yourself (tests). `submit` and `cancel` are thread-safe."""

    def __init__(
        self,
        target,
        drafter,
        config: EngineConfig = EngineConfig(),
        *,
        stop_ids=(),
        metrics=None,
        channel=None,
        acceptance=None,
    ):
        """`channel`: a `fanout.PlanChannel` when the mesh spans several processes (this is process 0): every plan
        goes to the other processes before it runs here. `acceptance`: the drafter's recorded conditional acceptance
        per draft position (tune.json's), the adaptive policy's prior until it has measured its own."""
        self.executor = Executor.of(target, drafter, config, stop_ids=stop_ids)  # checks the pair against config
        self.target, self.config, self.metrics, self.acceptance = target, config, metrics, acceptance
        self.stop_ids = self.executor.stop_ids  # the model's and `stop_ids`
        self.scheduler = Scheduler(
            config, config.draft, vocab_size=target.vocab_size, stop_ids=self.stop_ids, shapes=config.shapes
        )
        self.channel = channel
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._counters = None  # the loop's counters after the last step, for metric deltas
        self._pool_seen = (0, 0, 0)  # the scheduler's preemptions and prefix-cache queries and hits, counted so far

    # ------------------------------------------------------------------ public, thread-safe
    def check(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a request does not fit a slot (None if it does)."""
        return self.scheduler.check(prompt_len, max_tokens)

    def room(self, prompt_len: int) -> int:
        """The most new tokens a prompt of `prompt_len` tokens fits (0: none)."""
        return self.scheduler.room(prompt_len)

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt + max_tokens) any request fits: what /v1/models advertises."""
        return self.scheduler.max_model_len

    def submit(self, request: Request) -> None:
        """Queue a request (validated: prompt ids in the vocabulary, fits the context). Raises QueueFull."""
        self.scheduler.submit(request)
        if self.metrics is not None:
            # Only the queue depth: the occupancy gauge is the engine thread's. Setting it from here raced with an
            # admission and could leave a stale 0 standing while a slot was already held.
            self.metrics.queue_depth.set(self.scheduler.queue_depth)

    def cancel(self, request: Request, reason: str = "cancelled") -> None:
        """Finish `request` now (client gone, or a stop string seen by the caller); its slot is freed next step."""
        self.scheduler.cancel(request, reason)

    @property
    def queue_depth(self) -> int:
        return self.scheduler.queue_depth

    @property
    def occupancy(self) -> int:
        """Slots holding a request (prefilling or generating)."""
        return self.scheduler.occupancy

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="jaxspec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the background thread after its current step (requests still running are finished as cancelled)."""
        self._stopping = True
        self.scheduler.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self._observe(self.scheduler.abandon("cancelled"))
        if self.channel is not None:
            self.channel.publish(fanout.STOP)
            self.channel.close()
            self.channel = None

    # ------------------------------------------------------------------ the step
    def step(self) -> bool:
        """One step: schedule, execute, update. Returns False when there was nothing to do."""
        plan = self.scheduler.schedule()
        result = self._run(plan)
        if self.metrics is not None:
            for chunk in plan.prefill:
                self.metrics.prefill_chunks.labels("fed" if chunk.drafter else "not fed").inc()
        self._observe(self.scheduler.update(result))
        if result.counters is not None:
            self._observe_counters(result.counters, plan.segment, result.segment_seconds)
        return plan.busy

    def run_until_idle(self) -> None:
        """Step until every submitted request has finished (in the calling thread)."""
        while self.step():
            pass

    def warmup(self, on_progress: Callable[[str], None] = log.info) -> float:
        """Compile every program the engine uses (admit, prefill chunk, every segment bucket and program, a prefix
        hit, free) by serving two dummy requests, one of them cancelled, then run every segment program over live
        rows (`_first_runs`, which also times each draft shape for an adaptive engine); returns the seconds taken.
        On XLA:CPU the process's memory maps are checked before and while compiling (startup.py): a configuration
        that would run out of them raises StartupError before it does, naming what to change."""
        start = time.perf_counter()
        cfg, draft = self.config, self.config.draft
        programs = Programs.of(cfg)
        budget = MapBudget.here(platform_of(self.target.mesh))
        maps = f", about {budget.check(programs):,} memory maps of {budget.usable:,}" if budget else ""
        metrics, self.metrics = self.metrics, None  # the dummy requests are not traffic
        on_progress(
            f"compiling {programs.describe()}{maps}: {cfg.max_batch} slots x {cfg.max_context} positions, prefill "
            f"chunk {cfg.prefill_chunk}, {cfg.segment_cycles} cycles per segment, {jax.process_count()} process(es)"
        )
        self._dummy(Request([1] * 3, 2 + draft.num_steps, RowSpec(Sampling(1.0), seed=0)))
        self.step()  # admit + prefill + segment
        on_progress(f"  admit, prefill and segment programs compiled ({time.perf_counter() - start:.1f}s)")
        before, compiled = maps_in_use(), 0
        for b in cfg.buckets:
            for shape in cfg.shapes:
                for greedy in programs.programs:
                    # The dummy request finishes in its first cycles; then these run only to compile. A plan of its
                    # own (step 0: not the scheduler's), so the other processes of a server compile them too.
                    self._run(StepPlan(0, segment=Segment(b, shape, greedy, cfg.segment_cycles)))
                    compiled += 1
                if budget:  # what the programs so far took, before compiling more
                    budget.check_projection(programs, compiled, maps_in_use() - before)
            on_progress(
                f"  segments over {b} rows x {len(cfg.shapes)} drafts x {len(programs.programs)} programs compiled "
                f"({time.perf_counter() - start:.1f}s)"
            )
        self.run_until_idle()
        # A prefix hit's admission: a row admitted as if its first chunk were cached, then freed (every row is free
        # here; the next admission rewrites it).
        chunk = cfg.prefill_chunk
        self._run(StepPlan(0, admit=(RowAdmission(0, (1,) * (chunk + 1), 1, cached=chunk),)))
        self._run(StepPlan(0, free=(0,)))
        second = Request([1] * 3, 8)
        self._dummy(second)
        self.step()
        self.cancel(second)
        self.run_until_idle()
        used = f", {maps_in_use() - budget.start:,} memory maps (limit {budget.limit:,})" if budget else ""
        if times := self._first_runs():  # (none where its dummy requests do not fit a slot)
            on_progress(f"  every segment program run over live rows ({time.perf_counter() - start:.1f}s)")
        policy = DraftPolicy(cfg.shapes, cfg.segment_cycles)  # the warm-up's times were compiles
        if len(cfg.shapes) > 1:  # a fresh server's first segments run the predicted best shape, not a guess
            for (shape, rows), t in times.items():
                policy.calibrate(shape, rows, t)
            if self.acceptance is not None:
                policy.prior(self.acceptance)
        policy.since(self.executor.counters())
        self.scheduler.policy = policy
        seconds, self.metrics, s = time.perf_counter() - start, metrics, self.scheduler
        self._pool_seen = (s.preemptions, s.tables.queries, s.tables.hits)
        on_progress(f"warm-up done: {programs.count} segment programs in {seconds:.1f}s{used}")
        return seconds

    def _first_runs(self) -> dict:
        """Every segment program run over live rows of every batch bucket, through the scheduler, once compiled:
        dummy requests fill each bucket in turn for each draft shape (a `Calibration` policy choosing it), greedy
        ones (the static-greedy program) then sampled ones (the per-row program), none fed the drafter at prefill (so
        a chain's first segment on them runs its catch-up). The compile runs' rows are done, so the loop bodies in
        them never ran: on XLA:CPU each program's first run over live rows took 15-30 ms more than its next (the
        bundled pair, 8 rows: a plain segment 28.6 ms then 12.6, a k = 4 chain 70.3 then 44, sampled 104 then 72;
        a chain's first catch-up 10 ms), which a fresh server's first requests paid. A dummy request runs one cycle
        (all a first run needs), but an adaptive engine's greedy ones two segments' tokens: their cycle time per
        (shape, row bucket) is what its policy starts from (returned; nothing runs where they do not fit a slot).

        A segment program also runs the prefill chunks of rows admitted beside generating ones (a loop of its own in
        the program, whose first run cost as much: a plain segment over 8 rows with a 64-token chunk took 40.6 ms
        the first time and 21-22 ms after, a k = 4 chain's 85 then 57-60), so each bucket's round also has dummies
        whose prompt is two chunks long and that stop at its end (max_tokens 1), placed so that their second chunk
        runs inside a segment over the others at that bucket (`_round`): one, and on an adaptive engine (whose rows
        are fed the drafter at prefill or not, two paths of each chunk loop) a second, fed one."""
        cfg, C = self.config, self.config.prefill_chunk
        tokens = 2 * cfg.segment_cycles * (cfg.draft.num_steps + 1) if len(cfg.shapes) > 1 else 2
        if self.check(3, tokens) is not None:
            return {}
        fed = C + 2  # the prompt length Calibration feeds the drafter
        late = (C + 1, fed) if len(cfg.shapes) > 1 else (C + 1,)
        late = tuple(m for m in late if cfg.max_batch > 1 and self.check(m, 1) is None)
        timed = Calibration(cfg.shapes[0], fed)
        passes = [(timed, RowSpec(ignore_eos=True), tokens)]
        if cfg.greedy_program:  # else the greedy requests ran the per-row program already
            passes.append((Calibration(cfg.shapes[0], fed), RowSpec(Sampling(1.0), seed=0, ignore_eos=True), 2))
        real, rounds = self.scheduler.policy, 0
        try:
            for policy, spec, n in passes:
                self.scheduler.policy = policy
                for shape in cfg.shapes:
                    policy.shape = shape
                    for rows in cfg.buckets:
                        for request in _round(rows, cfg.max_batch, n, spec, late, f"jaxspec warm-up {rounds}"):
                            self._dummy(request)
                        self.run_until_idle()
                        rounds += 1
            return timed.seconds_per_cycle()
        finally:
            self.scheduler.policy = real

    # ------------------------------------------------------------------ internals
    def _dummy(self, request: Request) -> None:
        """Queue one of the warm-up's dummy requests: whatever --max-queue (they fill a bucket's slots at once)."""
        self.scheduler.submit(request, bounded=False)

    def _run(self, plan: StepPlan) -> StepResult:
        """Run `plan` here, after sending it to the other processes (which run every plan in the same order)."""
        if self.channel is not None:
            self.channel.publish(plan.to_bytes())
        return self.executor.run(plan)

    def _observe(self, report: StepReport) -> None:
        if self.metrics is None:
            return
        for d in report.delivered:
            n = d.count
            if d.since is None:
                self.metrics.ttft.observe(d.at - d.request.arrival)
                n -= 1
            elif n > 0:
                # Tokens of one step arrive together: each counts the mean gap since the previous arrival.
                for _ in range(n):
                    self.metrics.itl.observe((d.at - d.since) / n)
            self.metrics.observe_tokens(d.count)
        for r in report.finished:
            self.metrics.requests.labels(r.finish_reason).inc()
        self.metrics.queue_depth.set(self.scheduler.queue_depth)
        self.metrics.occupancy.set(self.scheduler.occupancy)
        self._observe_pool()

    def _observe_pool(self) -> None:
        """The pool's usage, and the preemptions and prefix-cache lookups since the last step (warm-up's excluded)."""
        s, t = self.scheduler, self.scheduler.tables
        totals = (s.preemptions, t.queries, t.hits)
        deltas = [now - seen for now, seen in zip(totals, self._pool_seen, strict=True)]
        self._pool_seen = totals
        for counter, delta in zip(
            (self.metrics.preemptions, self.metrics.prefix_queries, self.metrics.prefix_hits), deltas, strict=True
        ):
            counter.inc(delta)
        self.metrics.kv_cache_usage.set(t.pool.used / t.pool.num_blocks)

    def _observe_counters(self, counters, segment: Segment | None, seconds: float | None) -> None:
        if self.metrics is not None and self._counters is not None:
            delta = counters.minus(self._counters)
            self.metrics.observe_cycles(delta.cycles, delta.reached, delta.accepted, delta.accept_hist)
            if segment is not None and delta.cycles:
                measured = measured_tokens_per_second(delta, seconds) if seconds else None
                self.metrics.observe_segment(segment.draft.label, self.scheduler.policy.predicted, measured)
        self._counters = counters

    def _serve(self) -> None:
        while True:
            self.scheduler.wait(lambda: self._stopping)
            if self._stopping:
                return
            try:
                self.step()
            except Exception:  # a failed device call must not take the server down: fail what ran, start clean
                log.exception("engine step failed; failing the running requests and resetting the slots")
                self._observe(self.scheduler.abandon("error", queued=False))
                self.scheduler.tables.pool.clear()  # the pool is zeroed: nothing cached in it holds any more
                if self.channel is not None:
                    self.channel.publish(fanout.RESET)
                self.executor.reset()
                self._counters = None


def _round(rows: int, slots: int, n: int, spec: RowSpec, late: tuple[int, ...], salt: str) -> list[Request]:
    """A warm-up round's dummy requests, in the order they take free slots: `rows` short ones of `n` tokens, the
    last in slot `rows` - 1 (so their segments run at the bucket of `rows` rows), and one request per prompt length
    in `late` (two chunks; it ends at its prompt) as fit in `slots`: in the slots under the last short one first,
    then above it, where its second chunk runs beside the short ones' first cycles. Each late one's prompt is salted
    (`salt`): none is served another's first chunk from the prefix cache."""
    lates = [Request([1] * m, 1, dataclasses.replace(spec, cache_salt=f"{salt}.{i}")) for i, m in enumerate(late)]
    below = min(len(lates), rows - 1)
    above = min(len(lates) - below, slots - rows)
    shorts = [Request([1] * 3, n, spec) for _ in range(rows - below)]
    return [*lates[:below], *shorts, *lates[below : below + above]]
