"""The serving scheduler: every decision of an engine step, in plain Python (no jax; an import contract says so).

It owns the requests: the bounded queue, the slots (rows of the compiled batch), cancellations and admission limits.
`schedule()` turns them into one `StepPlan` (plan.py) and `update(result)` hands the executor's `StepResult` to the
requests. What it decides, in this order, for each step:
1. cancellations: a cancelled request leaves the queue, or its slot (the row is freed in the plan), at once;
2. admission: queued requests take the lowest free slots, in arrival order; each becomes a `RowAdmission` with its
   seed (drawn here when the request has none: an executor never draws one);
3. prefill: every slot still prefilling gets ONE chunk of its prompt, so a long prompt never stalls the others;
4. the segment, when a row is generating: the smallest compiled row bucket covering every generating row (each row
   reads its own cache blocks as far as its own length, so no context size is chosen), and the program:
   static-greedy while every occupied row is greedy and wants no logprobs (and the config allows it), else per-row;
5. reads: every generating row's tokens past what its request holds.
`update` delivers new tokens (`on_update(request, new_tokens)`), frees the slot of a finished row, and returns a
`StepReport` (who got how many tokens, who finished) from which the engine keeps its metrics.

Cache memory is a pool of fixed-size blocks (blocks.py): a request is admitted when the pool can give it its cached
prefix plus fresh blocks for what it reaches in its first segment, and each step first grows every row's blocks to
what it can reach in the next segment (deepest draft), oldest row first. When the pool runs out, the newest row is
preempted: its blocks go back and its request waits at the head of the queue, resumed by prefilling its prompt and
its tokens but the last, which the row is given as its first (recompute; a row's draws are keyed by position, so it
goes on as it would have: the same tokens for greedy and seeded sampling). Each change of a row's blocks goes into the
plan. The segment's draft shape is the `DraftPolicy`'s (adaptive.py): the candidate it predicts fastest for the rows
generating now and the live length of the longest of them, from the segment times and counters `update` hands it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Protocol

from jaxspec.decoding.draft_shape import DraftShape
from jaxspec.profiling.cost_model import pool_counters
from jaxspec.serving.adaptive import DraftPolicy
from jaxspec.serving.blocks import BlockPool, BlockTables
from jaxspec.serving.plan import (
    PrefillChunk,
    RowAdmission,
    RowBlocks,
    RowRead,
    RowResult,
    Segment,
    StepPlan,
    StepResult,
)
from jaxspec.serving.request import Delivery, QueueFull, Request, StepReport
from jaxspec.serving.speculation import Speculation

__all__ = ["QueueFull", "Request", "Scheduler", "SlotConfig", "StepReport"]

log = logging.getLogger("jaxspec.serving")


def random_seed() -> int:
    """A seed for a request that brings none (32 bits, as the loop's keys take)."""
    return secrets.randbits(32)


class SlotConfig(Protocol):
    """The static shape the scheduler plans for (the engine's config): slots, positions, buckets, chunking."""

    max_batch: int
    max_context: int
    prefill_chunk: int
    segment_cycles: int
    max_queue: int
    greedy_program: bool
    prefix_cache: bool

    @property
    def block(self) -> int: ...  # positions per cache block

    @property
    def pool_blocks(self) -> int: ...  # blocks in the cache pool

    @property
    def buckets(self) -> tuple[int, ...]: ...  # compiled segment row counts, ascending, the last = max_batch


@dataclasses.dataclass
class Slot:
    """A slot's request and its prefill progress."""

    request: Request
    next_chunk: int | None  # start of the next prefill chunk; None once prefill is done (the row is generating)
    order: int = 0  # admission order: the newest row is preempted first
    prompt_len: int = 0  # the row's prompt: the request's, and a resumed one's tokens but the last
    drafter: bool = True  # its prefill runs the drafter over the prompt (the policy's call at admission)
    counted: tuple[int, tuple[int, ...]] = (0, ())  # the row's counters (cycles, accepted) its request has counted


class Scheduler:
    """The queue, the slots and the plan of each step. `submit` and `cancel` are thread-safe; `schedule`, `update` and
    `abandon` belong to the engine's thread. `seeds()` draws a seed for a request without one (default: secrets).
    `draft`: the deepest draft shape (slots leave room for it); `shapes`: each segment's candidates (default: draft)."""

    def __init__(
        self,
        config: SlotConfig,
        draft: DraftShape,
        *,
        vocab_size: int,
        stop_ids: tuple[int, ...] = (),
        seeds: Callable[[], int] = random_seed,
        shapes: tuple[DraftShape, ...] = (),
    ):
        self.config, self.draft, self.vocab_size = config, draft, vocab_size
        self.policy = DraftPolicy(shapes or (draft,), config.segment_cycles)
        self._segment_run: Segment | None = None  # the last plan's segment
        self._segment_context = 0  # ... and the live length of its longest generating row (the policy's context)
        self.stop_ids = tuple(stop_ids)  # the model's (they stop every request)
        self.seeds = seeds
        self.slots: list[Slot | None] = [None] * config.max_batch
        self.step = 0  # the last plan's step number
        self._queue: collections.deque[Request] = collections.deque()
        self._cancels: list[tuple[Request, str]] = []
        self._free: list[int] = []  # rows to free in the next plan (abandoned slots)
        self._finished: list[Request] = []  # finished since the last report
        pool = BlockPool(config.pool_blocks, config.block)
        self.tables = BlockTables(pool, prefill_chunk=config.prefill_chunk, caching=config.prefix_cache)
        # A pool smaller than every slot's full context can run out mid-generation: then rows are preempted.
        self._preemptible = config.pool_blocks < config.max_batch * self.tables.blocks_for(config.max_context)
        self.preemptions, self._admissions = 0, itertools.count()
        self._lock = threading.Condition()

    # ------------------------------------------------------------------ public, thread-safe
    def check(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a request does not fit a slot (None if it does), stating the rule that refuses it."""
        room = self.room(prompt_len)
        if max_tokens <= room:
            return None
        cfg, cap, drafting = self.config, self._cap, self._drafting
        where = f"the context of {cfg.max_context} positions per slot"
        if cap < cfg.max_context:
            where = f"the cache pool's {cap} positions (kv-cache-tokens)"
        chunk = cfg.prefill_chunk
        resumed = prompt_len + (max_tokens - 1 if self._preemptible else 0)
        rule = (
            f"a prompt{' with the tokens of a preempted request' if self._preemptible else ''} is prefilled in whole "
            f"chunks of {chunk} positions plus one ({resumed} tokens take {-(-resumed // chunk) * chunk + 1}), and "
            f"{drafting} positions are kept for drafting; prompt + max_tokens up to {self.max_model_len} always fit "
            f"(max_model_len in /v1/models)"
        )
        if room == 0:
            return f"prompt of {prompt_len} tokens exceeds {where}: {rule}"
        return (
            f"prompt of {prompt_len} tokens + max_tokens {max_tokens} exceeds {where}: this prompt leaves room for "
            f"at most {room} new tokens ({rule})"
        )

    def room(self, prompt_len: int) -> int:
        """The most new tokens a request with a prompt of `prompt_len` tokens fits (0: the prompt does not fit): its
        reach (drafting included) within the context, and its prefill, whole chunks plus one position, too (a
        preempted request resumes by prefilling its prompt and its tokens so far but the last)."""
        chunked = self._longest_prefill
        if prompt_len > chunked:
            return 0
        room = self._cap - self._drafting - prompt_len
        if self._preemptible:
            room = min(room, chunked - prompt_len + 1)
        return max(room, 0)

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt + max_tokens) any request fits, whatever its split (`room`)."""
        return min(self._cap - self._drafting, self._longest_prefill + 1)

    @property
    def _cap(self) -> int:
        """Positions one row may reach: the context, or the cache pool's when smaller."""
        return min(self.config.max_context, self.config.pool_blocks * self.config.block)

    @property
    def _drafting(self) -> int:
        """Positions a row reaches past its budget (the deepest draft's lookahead, and one)."""
        return self.draft.reach(1, 1) - 1

    @property
    def _longest_prefill(self) -> int:
        """The most tokens a prefill takes: its whole chunks and one more position fit the row's reach."""
        chunk = self.config.prefill_chunk
        return (self._cap - 1) // chunk * chunk

    def submit(self, request: Request, *, bounded: bool = True) -> None:
        """Queue a request (validated: prompt ids in the vocabulary, fits the context). Raises QueueFull past
        max_queue waiting requests, unless not `bounded` (the warm-up's dummy requests, which fill a bucket's slots at
        once whatever the bound)."""
        request.validate(self.vocab_size)
        problem = self.check(len(request.prompt), request.max_tokens)
        if problem:
            raise ValueError(problem)
        with self._lock:
            if bounded and len(self._queue) >= self.config.max_queue:
                raise QueueFull(f"the queue holds {self.config.max_queue} waiting requests; retry later")
            request.arrival = time.perf_counter()
            self._queue.append(request)
            self._lock.notify_all()

    def cancel(self, request: Request, reason: str = "cancelled") -> None:
        """Finish `request` at the next `schedule()` (client gone, or a stop string seen by the caller)."""
        with self._lock:
            self._cancels.append((request, reason))
            self._lock.notify_all()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def occupancy(self) -> int:
        """Slots holding a request (prefilling or generating)."""
        return sum(s is not None for s in self.slots)

    @property
    def has_work(self) -> bool:
        """A step would do something: requests queued, cancellations pending, or slots held."""
        return bool(self._queue or self._cancels or self._free) or self.occupancy > 0

    def wait(self, stop: Callable[[], bool]) -> None:
        """Block until there is work or `stop()` holds (call `wake()` after changing what `stop` reads)."""
        with self._lock:
            while not stop() and not self.has_work:
                self._lock.wait()

    def wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    # ------------------------------------------------------------------ the engine thread's
    def schedule(self) -> StepPlan:
        """Decide the next step (see the module docstring) and return its plan."""
        free = self._apply_cancels() + self._grow()
        admit = self._admit_queued()
        prefilling = [i for i, s in enumerate(self.slots) if s is not None and s.next_chunk is not None]
        running = [i for i, s in enumerate(self.slots) if s is not None and s.next_chunk is None]
        prefill = tuple(self._prefill_chunk(i) for i in prefilling)
        segment = self._segment(running) if running else None
        read = tuple(
            RowRead(
                i, len(s.request.prompt) + len(s.request.tokens), s.request.echo and s.request.prompt_logprobs is None
            )
            for i, s in enumerate(self.slots)
            if s is not None and s.next_chunk is None
        )
        self.step += 1
        self._segment_run = segment
        blocks = tuple(RowBlocks(row, b) for row, b in self.tables.changes())
        return StepPlan(self.step, free, admit, prefill, segment, read, blocks)

    def update(self, result: StepResult) -> StepReport:
        """Hand a step's new tokens to their requests; free the slots of finished ones."""
        if result.step != self.step:
            raise ValueError(f"StepResult.step: expected {self.step} (the last plan's), got {result.step}")
        now = time.perf_counter()
        delivered, unfed = [], []  # each unfed row's (reached, accepted) per draft position in a drafting segment
        for row in result.rows:
            slot = self.slots[row.row]
            if slot is None or slot.next_chunk is not None:
                raise ValueError(f"StepResult.rows: row {row.row} holds no generating request")
            r, new = slot.request, list(row.tokens)
            gained = self._count(slot, row)
            if gained is not None and not slot.drafter and not self._segment_run.draft.plain:
                unfed.append(_row_counters(self._segment_run.draft, *gained))
            if row.prompt_logprobs is not None:
                r.prompt_logprobs = list(row.prompt_logprobs)
            if row.logprobs is not None:
                r.token_logprobs.extend(row.logprobs)
            if new:
                delivered.append(Delivery(r, len(new), r.last_token_at, now))
                r.first_token_at = r.first_token_at or now
                r.last_token_at = now
                r.tokens.extend(new)
            if row.done:
                self.slots[row.row] = None
                self.tables.release(row.row)
                stopped = r.tokens and r.tokens[-1] in (() if r.spec.ignore_eos else self.stop_ids) + r.spec.stop_ids
                self._finish(r, "stop" if stopped else "length", new)
            elif new:
                r.notify(new)
        if self._segment_run is not None and result.counters is not None:
            seconds, context = result.segment_seconds, self._segment_context
            self.policy.observe(
                self._segment_run, result.counters, seconds, context, pool_counters(unfed) if unfed else None
            )
        return StepReport(tuple(delivered), self._take_finished())

    def abandon(self, reason: str, *, queued: bool = True) -> StepReport:
        """Finish every slotted request (and, with `queued`, every queued one) with `reason`: the engine stops, or a
        step failed. The slots are free at once; their rows are freed in the next plan."""
        waiting = []
        if queued:
            with self._lock:
                waiting, self._queue = list(self._queue), collections.deque()
        for i, s in enumerate(self.slots):
            if s is not None:
                self.slots[i] = None
                self.tables.release(i)
                self._free.append(i)
                self._finish(s.request, reason)
        for request in waiting:
            self._finish(request, reason)
        return StepReport((), self._take_finished())

    # ------------------------------------------------------------------ internals
    def _count(self, slot: Slot, row: RowResult) -> tuple[int, list[int]] | None:
        """Add what the row's counters gained since its request last counted them to the request's speculation,
        under this step's draft shape (only a segment runs cycles); returns what they gained (cycles, accepted per
        draft position), None where the row ran no cycle."""
        zero = (0,) * self.draft.num_steps
        (cycles, accepted), now = slot.counted, row.accepted or zero
        gained = row.cycles - cycles, [a - b for a, b in zip(now, accepted or zero, strict=True)]
        if gained[0] and self._segment_run is None:
            raise ValueError(f"StepResult.rows: row {row.row} ran {gained[0]} cycles in a step without a segment")
        slot.counted = row.cycles, now
        if not gained[0]:
            return None
        slot.request.speculation = slot.request.speculation.plus(self._segment_run.draft, *gained)
        return gained

    def _apply_cancels(self) -> tuple[int, ...]:
        """Finish the cancelled requests; returns the rows to free (theirs and any abandoned ones)."""
        with self._lock:
            cancels, self._cancels = self._cancels, []
            for request, _ in cancels:
                if request in self._queue:
                    self._queue.remove(request)
        free, self._free = self._free, []
        for request, reason in cancels:
            if request.finished:
                continue
            if request.slot is not None:
                self.slots[request.slot] = None
                self.tables.release(request.slot)
                free.append(request.slot)
            self._finish(request, reason)
        return tuple(dict.fromkeys(free))

    def _admit_queued(self) -> tuple[RowAdmission, ...]:
        """Queued requests into free slots, in order, while the pool can hold each one's first segment. A resumed
        (preempted) request's row prompt is its prompt and its tokens but the last (the row's first token)."""
        admitted = []
        while None in self.slots:
            with self._lock:
                if not self._queue:
                    break
                request, queued = self._queue[0], len(self._queue)
            row, given = self.slots.index(None), request.tokens[-1:]
            have = len(request.tokens) - len(given)
            prompt = (*request.prompt, *request.tokens[:have])
            # echo scores every prompt position, so it reuses no cached prefix (that skipped their scores)
            # the rows it will be served with: those in slots, and the queue's (itself first) in the free ones
            rows = min(len(self.slots), len(self.slots) - self.slots.count(None) + queued)
            fed = sum(t.drafter for t in self.slots if t is not None)  # fed rows in slots (`_segment`: running ones)
            drafter = self.policy.feeds_drafter(len(prompt), rows, fed)
            reach = self._next_reach(request)
            salt = request.spec.cache_salt
            cached = self.tables.admit(row, prompt, reach, lookup=not request.echo, drafter=drafter, salt=salt)
            if cached is None:
                break
            with self._lock:
                self._queue.popleft()
            self.policy.admitted(drafter)
            if not given:
                request.cached_tokens = cached
            if request.speculation is None:  # a resumed request keeps what it had
                request.speculation = Speculation(self.draft.num_steps)
            if request.spec.seed is None:  # kept: a resumed request draws from the same seed
                request.spec = dataclasses.replace(request.spec, seed=self.seeds())
            spec = request.spec
            row_spec = dataclasses.replace(
                spec, logprobs=spec.logprobs or request.echo, min_new=max(spec.min_new - have, 0)
            )
            first = given[0] if given else None
            admitted.append(RowAdmission(row, prompt, request.max_tokens - have, row_spec, cached, first))
            request.slot = row
            self.slots[row] = Slot(request, cached, next(self._admissions), len(prompt), drafter)
        return tuple(admitted)

    def _next_reach(self, request: Request) -> int:
        """Positions its row must hold after the next segment (the deepest draft's)."""
        return _row_reach(self.draft, request, self.config.segment_cycles)

    def _grow(self) -> tuple[int, ...]:
        """Blocks for what every generating row reaches in the next segment, oldest row first; when the pool runs
        out, the newest row is preempted (its request resumes later). Returns the preempted rows."""
        preempted = []
        by_age = sorted((s.order, i) for i, s in enumerate(self.slots) if s is not None)
        for _, row in by_age:
            slot = self.slots[row]
            while slot is not None and not self.tables.grow(row, self._next_reach(slot.request)):
                newest = max((s.order, i) for i, s in enumerate(self.slots) if s is not None)[1]
                self._preempt(newest)
                preempted.append(newest)
                slot = self.slots[row]
        return tuple(preempted)

    def _preempt(self, row: int) -> None:
        request = self.slots[row].request
        self.slots[row], request.slot, self.preemptions = None, None, self.preemptions + 1
        self.tables.release(row)
        with self._lock:
            self._queue.appendleft(request)
        log.info("preempted row %d (%d tokens so far): the cache pool is full", row, len(request.tokens))

    def _prefill_chunk(self, row: int) -> PrefillChunk:
        slot, C = self.slots[row], self.config.prefill_chunk
        start = slot.next_chunk
        slot.next_chunk = None if slot.prompt_len - 1 < start + C else start + C
        self.tables.prefilled(row, start + C)
        return PrefillChunk(row, start, slot.drafter)

    def _segment(self, running: list[int]) -> Segment:
        """A segment over the smallest row bucket that holds the `running` rows (generating before this step's
        prefill chunks), drafting the policy's shape for these rows (how many of them were fed the drafter at
        prefill, and the live length of the longest), one cycle when the policy probes, static-greedy while every
        occupied row is greedy (and the config allows it), else per-row. Each row reads its own cache blocks as far
        as its own length: no context size is chosen."""
        cfg = self.config
        b = next(b for b in cfg.buckets if b > max(running))
        generating_rows = [t.request for t in self.slots if t is not None and t.next_chunk is None]
        self._segment_context = max(len(r.prompt) + len(r.tokens) for r in generating_rows)
        fed = sum(self.slots[i].drafter for i in running)
        draft = self.policy.choose(b, len(running), self._segment_context, fed)
        greedy = cfg.greedy_program and all(s is None or _greedy_program_serves(s.request) for s in self.slots)
        return Segment(b, draft, greedy, 1 if self.policy.probing else cfg.segment_cycles)

    def _finish(self, request: Request, reason: str, new: list[int] | None = None) -> None:
        request.finish_reason, request.slot = reason, None
        self._finished.append(request)
        request.notify(new or [])

    def _take_finished(self) -> tuple[Request, ...]:
        finished, self._finished = tuple(self._finished), []
        return finished


def _row_counters(draft: DraftShape, cycles: int, accepted: list[int]) -> tuple[list[int], list[int]]:
    """A row's `cycles` of `draft` that accepted `accepted` drafts per position as the loop's (reached, accepted)
    counters count them: a position is reached where the one before it was accepted, the first in every cycle."""
    return [cycles, *accepted[: draft.num_steps - 1]] + [0] * (len(accepted) - draft.num_steps), accepted


def _row_reach(draft: DraftShape, request: Request, cycles: int) -> int:
    """What `request`'s row reaches in `cycles` cycles of `draft` (+1: a row prefilled in this step has its first
    token, not yet read)."""
    prompt = len(request.prompt)
    return draft.reach(prompt + len(request.tokens) + 1, prompt + request.max_tokens, cycles)


def _greedy_program_serves(request: Request) -> bool:
    """The static-greedy program can run this request's row: greedy, nothing to score and no stop ids to mask (it has
    no logits)."""
    spec = request.spec
    return spec.sampling.greedy and not (spec.logprobs or request.echo or spec.min_new)
