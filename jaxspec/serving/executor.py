"""The serving executor: runs one `StepPlan` (plan.py) on the device and returns its `StepResult`.

It owns the device side of serving: the loop state of every slot (`LoopState`, B rows x S positions) and the
compiled programs that change it (admit, free, one prefill chunk of one row, a segment over a window of rows and
positions). It decides nothing: which rows, chunks, buckets and program run is the plan's, so every process of a
multi-process server runs the same programs in the same order from the same plans. The plan's parts run in the order
plan.py gives (free, admit, prefill, segment, read).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.draft_shape import DraftShape
from jaxspec.decoding.generate import LoopCache
from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.state import Logprobs, LoopConfig, LoopState, RowInit
from jaxspec.serving.plan import Counters, RowResult, Segment, StepPlan, StepResult
from sharding.multihost import to_host


class Executor:
    """The slots' loop state and the programs that run a plan on it. `draft` is the shape every segment drafts
    (compiled once); `stop_ids` the model's stop ids (they stop every row)."""

    def __init__(
        self,
        target,
        drafter,
        draft: DraftShape,
        *,
        max_batch: int,
        max_context: int,
        prefill_chunk: int,
        stop_ids: tuple[int, ...],
    ):
        self.target, self.draft = target, draft
        self.drafter = drafter if not draft.plain else None
        self.max_batch, self.max_context, self.prefill_chunk = max_batch, max_context, prefill_chunk
        self.loop = LoopCache.of(target).loop(target, self.drafter)  # shared: another executor reuses its programs
        # The per-row program scores tokens for the rows that want logprobs (skipped at run time when none does), so
        # logprobs compile nothing extra; the static-greedy program has no logits and never runs such a row.
        self.per_row = LoopConfig(draft, None, tuple(stop_ids), prefill_chunk, prefill_chunk, logprobs=True)
        self.greedy = dataclasses.replace(self.per_row, sampling=Sampling(), logprobs=False)
        # Chains only: the static-greedy program leaves a placeholder in greedy rows' draft_q_BV, which a per-row
        # segment must replace first (`_fix_greedy_q`). Trees keep the root's logits there (tree acceptance reads
        # only the target), so there is nothing to fix.
        self._greedy_leaves_q = not draft.plain and not draft.tree
        self._q_stale = False
        self.state = self._empty()

    def reset(self) -> None:
        """Every row free again (after a failed step: whatever the device holds may be half-written)."""
        self.state, self._q_stale = self._empty(), False

    def _empty(self) -> LoopState:
        target, drafter, B, S = self.target, self.drafter, self.max_batch, self.max_context
        return LoopState.empty(target, drafter, self.draft, B, S, per_row=True, logprobs=True)

    def _params(self):
        return self.target.params, self.drafter.params if self.drafter is not None else None

    # ------------------------------------------------------------------ one plan
    def run(self, plan: StepPlan) -> StepResult:
        """Run `plan` (free, admit, prefill, segment, read) and return what its reads found."""
        for row in plan.free:
            self.state = _free(self.state, np.int32(row))
        for a in plan.admit:
            row = a.prompt, a.max_new, a.sampling, a.stop_ids, a.seed, self.max_context
            init = RowInit.of(*row, a.logprobs, a.min_new, a.ignore_eos)
            self.state = _admit(self.state, np.int32(a.row), init)
        for chunk in plan.prefill:
            self.state = self.loop.prefill_slot(
                self.per_row, *self._params(), self.state, np.int32(chunk.row), np.int32(chunk.start)
            )
        if plan.segment is not None:
            self.segment(plan.segment)
        if not plan.busy:
            return StepResult(plan.step)
        return StepResult(plan.step, self._read(plan), self.counters())

    def segment(self, segment: Segment) -> None:
        """`segment.cycles` cycles over rows [0, rows) and positions [0, positions) with the segment's program."""
        if segment.draft != self.draft:
            raise ValueError(f"Segment.draft: this executor runs {self.draft.label}, got {segment.draft.label}")
        program = self.greedy if segment.greedy else self.per_row
        if segment.greedy:
            self._q_stale = self._greedy_leaves_q
        elif self._q_stale:
            self.state = _fix_greedy_q(self.state)
            self._q_stale = False
        cycles = jnp.int32(segment.cycles)
        if (segment.rows, segment.positions) == (self.max_batch, self.max_context):
            self.state = self.loop.run(program, *self._params(), self.state, cycles)
            return
        part = self.loop.run(program, *self._params(), _window(self.state, segment.rows, segment.positions), cycles)
        self.state = _put(self.state, part)

    def counters(self) -> Counters:
        """The loop's running totals (cycles, per-depth reached / accepted, the accepted-length histogram)."""
        s = self.state
        cycles, *counts = to_host((s.cycles, s.reached_J, s.accepted_J, s.accept_hist_T))
        return Counters(int(cycles), *(tuple(c.tolist()) for c in counts))

    def _read(self, plan: StepPlan) -> tuple[RowResult, ...]:
        if not plan.read:
            return ()
        s = self.state
        host = (s.tokens_BS, s.prompt_len_B, s.end_B, s.done_B, s.wants_logprobs_B)
        tokens_BS, prompt_len_B, end_B, done_B, wants_B = to_host(host)  # one read per step, not per row
        results = []
        for r in plan.read:
            end = int(end_B[r.row])
            result = RowResult(r.row, tuple(tokens_BS[r.row, r.start : end].tolist()), bool(done_B[r.row]))
            if wants_B[r.row]:  # token i's scores are at position i - 1
                scores = jax.tree.leaves(to_host(_row_logprobs(s.logprobs, np.int32(r.row))))
                prompt = _scores(scores, 0, int(prompt_len_B[r.row]) - 1) if r.prompt else None
                result = dataclasses.replace(
                    result, logprobs=_scores(scores, r.start - 1, end - 1), prompt_logprobs=prompt
                )
            results.append(result)
        return tuple(results)


def _scores(scores: list[np.ndarray], start: int, end: int) -> tuple:
    """The `TokenLogprob`s of positions [start, end) of one row's (token [S], top ids [S, N], top [S, N])."""
    token_S, ids_SN, top_SN = scores
    return tuple((float(token_S[p]), tuple(ids_SN[p].tolist()), tuple(top_SN[p].tolist())) for p in range(start, end))


@jax.jit
def _row_logprobs(logprobs: Logprobs, row) -> Logprobs:
    """One row of the logprob buffers (what a read copies to the host, not the whole [B, S, N])."""
    return jax.tree.map(lambda x: x[row], logprobs)


_admit = jax.jit(LoopState.admit, donate_argnums=0)
_free = jax.jit(LoopState.free, donate_argnums=0)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _window(state: LoopState, rows: int, positions: int) -> LoopState:
    return state.window(rows, positions)


@functools.partial(jax.jit, donate_argnums=0)
def _put(state: LoopState, part: LoopState) -> LoopState:
    return state.put(part)


@jax.jit
def _fix_greedy_q(state: LoopState) -> LoopState:
    """Before a per-row segment that follows greedy ones: each greedy row's draft distribution as the per-row program
    would have left it (a point mass on its draft token; the greedy program keeps a placeholder there)."""
    q_BV = state.draft_q_BV
    point_BV = jax.nn.one_hot(state.draft_B, q_BV.shape[1], dtype=q_BV.dtype)
    greedy_B = state.row_sampling.temperature_B == 0
    return state.replace(draft_q_BV=jnp.where(greedy_B[:, None], point_BV, q_BV))
