"""The serving executor: runs one `StepPlan` (plan.py) on the device and returns its `StepResult`.

It owns the device side of serving: the loop state of every slot (`LoopState`, B rows x S positions, without its
caches), the cache pool (`CachePool`: the target's latent cache and the drafter's KV in blocks of positions; block 0
is the null block) with each row's block table, and the compiled programs that change them (admit, free, a step's
prefill chunks and its segment over a window of rows). A segment's program runs the step's prefill chunks first,
then its cycles (a mixed step: a step with a generating row runs no prefill program of its own; the same program
without a segment runs the chunks alone when no row is generating). A prefill chunk or a segment runs the compiled
loop on a window of the state's rows whose caches are the pool itself (`models.cache.Paged`): attention reads each
row's own blocks through its table, as far as that row's own length, and a step writes its new entries straight
into the row's blocks; nothing is copied out of the pool and back. It decides nothing: which rows, chunks, buckets
and program run is the plan's, so every process of a multi-process server runs the same programs in the same order
from the same plans. The plan's parts run in the order plan.py gives (free, blocks, admit, prefill, segment, read).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.draft_shape import DraftShape
from jaxspec.decoding.generate import LoopCache
from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.state import DRAFTER_ONLY, Logprobs, LoopConfig, LoopState, RowInit
from jaxspec.models.cache import Paged
from jaxspec.serving.plan import Counters, PrefillChunk, RowResult, Segment, StepPlan, StepResult
from jaxspec.serving.startup import cpu_compiler_options
from sharding.mesh import platform_of
from sharding.multihost import put_global, to_host


class CachePool(NamedTuple):
    """The pool's arrays: the target's latent cache [L, N, block, Y] and the drafter's cache ([N, block, ...] each;
    None without a drafter), N blocks of `block` positions (what `init_cache(N, block)` makes)."""

    target: jax.Array
    drafter: Any


class ExecutorConfig(Protocol):
    """What an executor is built from (the engine's `EngineConfig`)."""

    draft: DraftShape
    max_batch: int
    max_context: int
    prefill_chunk: int

    @property
    def shapes(self) -> tuple[DraftShape, ...]: ...  # the draft shapes segments run

    @property
    def pool_blocks(self) -> int: ...  # blocks in the cache pool

    @property
    def block(self) -> int: ...  # positions per cache block


class Executor:
    """The slots' loop state, the cache pool and the programs that run a plan on them. `draft` is the shape the
    state is built for and prefill drafts with; `shapes` the draft shapes a segment may run (default: `draft` alone;
    more: chains no deeper than `draft`, or plain decoding beside a tree, all running on the one state, each compiled
    once); `stop_ids` the model's
    stop ids (they stop every row); `pool` (blocks, block size): the pool's size (the null block aside) and its
    blocks' positions."""

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
        pool: tuple[int, int],
        shapes: tuple[DraftShape, ...] = (),
    ):
        self.target, self.draft, self.stop_ids = target, draft, tuple(stop_ids)
        self.drafter = drafter if not draft.plain else None
        self.max_batch, self.max_context, self.prefill_chunk = max_batch, max_context, prefill_chunk
        self.loop = LoopCache.of(target).loop(target, self.drafter)  # shared: another executor reuses its programs
        self.shapes = shapes or (draft,)
        labels = [shape.label for shape in self.shapes]
        # A tree keeps its next root's logits where a chain keeps its draft's distribution: no chain beside a tree.
        beside = {DraftShape(0)} if draft.tree else {s for s in self.shapes if not s.tree and s < draft}
        if draft not in self.shapes or not set(self.shapes) - {draft} <= beside:
            raise ValueError(
                f"Executor.shapes: expected {draft.label} and chains no deeper (beside a tree: plain), got {labels}"
            )
        # Per shape, (the static-greedy program, the per-row one). The per-row program scores tokens for the rows
        # that want logprobs (skipped at run time when none does), so logprobs compile nothing extra; the
        # static-greedy program has no logits and never runs such a row. Plain segments on a state with a drafter
        # keep their target states for it (`LoopConfig.track_drafter`): a drafting segment first catches it up.
        self.programs = {}
        for shape in self.shapes:
            track = self.drafter is not None and shape.plain
            per_row = LoopConfig(shape, None, tuple(stop_ids), prefill_chunk, prefill_chunk, True, track)
            self.programs[shape] = (dataclasses.replace(per_row, sampling=Sampling(), logprobs=False), per_row)
        self.per_row = self.programs[draft][1]  # the prefill's: the drafter's first draft for the deepest shape
        # Chains only: the static-greedy program leaves a placeholder in greedy rows' draft_q_BV, which a per-row
        # segment must replace first (`LoopState.greedy_q_repaired`). Trees keep the root's logits there (tree
        # acceptance reads only the target), so there is nothing to fix.
        self._greedy_leaves_q = self.drafter is not None and not draft.tree
        self._q_stale = False
        self.blocks, self.block = pool
        cpu = platform_of(target.mesh) == "cpu"
        self._program = _segment_program(cpu_compiler_options() if cpu else ())
        self.reset()

    @classmethod
    def of(cls, target, drafter, config: ExecutorConfig, *, stop_ids: tuple[int, ...] = ()) -> Executor:
        """The executor of an engine's `config`, checked against the pair (a draft needs a drafter that can draft it;
        slots are prefilled one row at a time, so the mesh has no data axis; the context fits the model), stopping
        every row at the model's stop ids and `stop_ids`. The engine, a follower process and the tests build theirs
        here, so they run the same programs."""
        draft = config.draft
        if not draft.plain and drafter is None:
            raise ValueError(f"num_steps={draft.num_steps} needs a drafter (pass num_steps=0 for plain decoding)")
        if drafter is not None:
            draft.check_drafter(drafter.config.draft_vocab_size)
        if target.mesh.shape.get("data", 1) != 1:
            raise ValueError("serving: the mesh's data axis must be 1 (slots are prefilled one row at a time)")
        if config.max_context > target.config.max_position_embeddings:
            raise ValueError(
                f"EngineConfig.max_context {config.max_context} exceeds the model's context of "
                f"{target.config.max_position_embeddings} positions"
            )
        return cls(
            target,
            drafter,
            draft,
            max_batch=config.max_batch,
            max_context=config.max_context,
            prefill_chunk=config.prefill_chunk,
            stop_ids=tuple(sorted(set(target.config.stop_token_ids) | set(stop_ids))),
            shapes=config.shapes,
            pool=(config.pool_blocks, config.block),
        )

    def reset(self) -> None:
        """Every row free again and the pool zeroed (after a failed step: the device may hold half-written values)."""
        target, drafter, B, S = self.target, self.drafter, self.max_batch, self.max_context
        lazy = len(self.shapes) > 1  # plain segments leave the drafter behind; the chain's catch it up
        empty = dict(per_row=True, logprobs=True, lazy_drafter=lazy, caches=False)
        self.state = LoopState.empty(target, drafter, self.draft, B, S, **empty)
        blocks = self.blocks + 1
        self.pool = CachePool(
            target.init_cache(blocks, self.block), drafter.init_cache(blocks, self.block) if drafter else None
        )
        self.tables = np.zeros((B, S // self.block), np.int32)  # each row's blocks; 0: the null block
        self._tables = put_global(self.tables.copy(), self.state.tokens_BS.sharding)
        self._q_stale = False

    def _params(self):
        return self.target.params, self.drafter.params if self.drafter is not None else None

    # ------------------------------------------------------------------ one plan
    def run(self, plan: StepPlan) -> StepResult:
        """Run `plan` (free, blocks, admit, prefill, segment, read) and return what its reads found."""
        for row in plan.free:
            self.state = _free(self.state, np.int32(row))
        if plan.blocks:
            for b in plan.blocks:
                self.tables[b.row] = 0
                self.tables[b.row, : len(b.blocks)] = b.blocks
            self._tables = put_global(self.tables.copy(), self.state.tokens_BS.sharding)
        for a in plan.admit:
            init = RowInit.of(a.prompt, a.max_new, a.spec, self.max_context, a.first)
            self.state = _admit(self.state, np.int32(a.row), init)
        if plan.prefill and plan.segment is None:  # the chunks alone: no row is generating
            self._run_program(plan.prefill)
        seconds = None
        if plan.segment is not None:
            jax.block_until_ready(self.state)  # the segment's own time: what the scheduler's cost estimates learn
            start = time.perf_counter()
            self.segment(plan.segment, plan.prefill)
            jax.block_until_ready(self.state)
            seconds = None if plan.prefill else time.perf_counter() - start  # with chunks: not the cycles' time
        if not plan.busy:
            return StepResult(plan.step)
        return StepResult(plan.step, self._read(plan), self.counters(), seconds)

    def segment(self, segment: Segment, prefill: tuple[PrefillChunk, ...] = ()) -> None:
        """The `prefill` chunks in order, then `segment.cycles` cycles over rows [0, rows), as the segment's one
        program (the same program with no chunks: their count is an argument)."""
        if segment.draft not in self.programs:
            labels = [shape.label for shape in self.shapes]
            raise ValueError(f"Segment.draft: this executor runs {labels}, got {segment.draft.label}")
        program = self.programs[segment.draft][0 if segment.greedy else 1]
        fix = False
        if segment.greedy:
            self._q_stale = self._greedy_leaves_q
        elif self._q_stale:
            fix, self._q_stale = True, False
        window = segment.rows, None, not segment.draft.plain
        self._run_program(prefill, program, window, fix, segment.cycles)

    def _run_program(self, prefill, program: LoopConfig | None = None, window=None, fix=False, cycles=0) -> None:
        """`_prefill_and_run`: the `prefill` chunks, then (with a `program`) `cycles` cycles over `window`."""
        chunks = np.zeros((self.max_batch, 3), np.int32)  # (row, start, drafter) of each; padding never runs
        chunks[: len(prefill)] = np.reshape([(c.row, c.start, c.drafter) for c in prefill], (-1, 3))
        programs = self.loop, self.per_row, program, window
        runs = np.int32(len(prefill)), np.bool_(fix), np.int32(cycles)
        self.state, self.pool = self._program(
            *programs, self._params(), self.state, self.pool, self._tables, chunks, *runs
        )

    def counters(self) -> Counters:
        """The loop's running totals (cycles, per-depth reached / accepted, the accepted-length histogram)."""
        s = self.state
        cycles, *counts = to_host((s.cycles, s.reached_J, s.accepted_J, s.accept_hist_T))
        return Counters(int(cycles), *(tuple(c.tolist()) for c in counts))

    def _read(self, plan: StepPlan) -> tuple[RowResult, ...]:
        if not plan.read:
            return ()
        s = self.state
        host = (s.tokens_BS, s.prompt_len_B, s.end_B, s.done_B, s.settings.logprobs_B)
        counters = (s.row_cycles_B, s.row_accepted_BJ)  # the rows' own (speculation.py)
        # one read per step, not per row
        (tokens_BS, prompt_len_B, end_B, done_B, wants_B), (cycles_B, accepted_BJ) = to_host((host, counters))
        results = []
        for r in plan.read:
            end = int(end_B[r.row])
            tokens, counts = tuple(tokens_BS[r.row, r.start : end].tolist()), tuple(accepted_BJ[r.row].tolist())
            result = RowResult(r.row, tokens, bool(done_B[r.row]), cycles=int(cycles_B[r.row]), accepted=counts)
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


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _gather(
    state: LoopState, pool: CachePool, tables, start, rows: int, positions: int | None, drafter: bool = True
) -> LoopState:
    """The window of rows [start, start + rows) and positions [0, positions) (all: None). Its caches are the pool's
    (`Paged`: read and written in place through the rows' block tables; nothing is copied out): the target's, and
    the drafter's with `drafter` (else None)."""
    window = state.window(rows, positions, start)
    block = state.tokens_BS.shape[1] // tables.shape[1]  # not the pool's: a striped pool (--dcp) holds block / dcp
    blocks = jax.lax.dynamic_slice_in_dim(tables, start, rows)[:, : window.tokens_BS.shape[1] // block]
    drafts = Paged(pool.drafter, blocks) if drafter else None
    return window.replace(target_cache=Paged(pool.target, blocks), draft_cache=drafts)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _scatter(state: LoopState, pool: CachePool, part: LoopState, start) -> tuple[LoopState, CachePool]:
    """Put `part`, a `_gather`ed window from row `start`, back: its rows into the state, and the pools as the window
    left them (written in place; a window without the drafter's leaves the pool's as it is)."""
    drafter = pool.drafter if part.draft_cache is None else part.draft_cache.pool
    state = state.put(part.replace(target_cache=None, draft_cache=None), start)
    return state, CachePool(part.target_cache.pool, drafter)


def _prefill_and_run(loop, prefill, cfg, window, params, state, pool, tables, chunks, count, fix, cycles):
    """One segment's program: the prefill chunks `chunks[:count]` ((row, start, drafter) each, in order; the
    loop's `prefill_slot` under config `prefill`, each row gathered over every position; on a state with a lazy
    drafter, the drafter runs over the chunk or, with `drafter` 0, not at all: a drafting segment drafts the row's
    first draft when it first runs on it), then
    `cycles` cycles of `cfg` over the window (rows, positions, with the drafter's cache or not: a plain segment
    leaves it as it is) from row 0 (`cfg` None: the chunks alone, in a step with no generating row). Nothing of the
    state or the pool is copied out and in between programs. A chunk that ends a prompt activates its row before the
    cycles, as a separate prefill program before the segment did; without chunks the loop over them runs no
    iteration.

    The target states plain cycles keep for the drafter (`aux_BSI`, [B, S, 3 x hidden]) stay out of the chunks (which
    neither read nor write them), and go into a segment whole, never as a window of its rows put back (XLA copied the
    whole buffer twice per program when they went through the chunks' loop and a window's put): plain cycles write
    them in place, a chain's catch-up reads them (`_lazy_segment`)."""

    def chunk(i, carry):
        state, pool = carry
        row, start = chunks[i, 0], chunks[i, 1]
        feed = chunks[i, 2] > 0 if state.drafted_B is not None else None  # a fixed shape always feeds it
        part = _gather(state, pool, tables, row, 1, None)
        part = loop.prefill_slot(prefill, *params, part, jnp.int32(0), start, feed)
        return _scatter(state, pool, part, row)

    state, aside = state.set_aside("aux_BSI")
    state, pool = jax.lax.fori_loop(0, count, chunk, (state, pool))
    if cfg is None:
        return state.replace(**aside), pool
    if cfg.sampling is None:  # the per-row program after greedy ones: greedy rows' q as it would have left them.
        # Only q goes through the conditional, before `aux_BSI` is back: with the whole state through it (its results
        # carried every field, `aux_BSI` included), a per-row plain segment over 8 rows took 1.03-1.05x as long (four
        # in-engine A/Bs on the bundled pair, CPU; no difference over 1 row).
        q = lambda s: s.draft_q_BV  # noqa: E731
        state = state.replace(draft_q_BV=jax.lax.cond(fix, lambda s: q(_greedy_q_repaired(s)), q, state))
    state, kept = state.replace(**aside), aside["aux_BSI"]
    if kept is not None:
        return _lazy_segment(loop, cfg, window, params, state, pool, tables, cycles)
    part = loop.run(cfg, *params, _gather(state, pool, tables, jnp.int32(0), *window), cycles)
    return _scatter(state, pool, part, jnp.int32(0))


@functools.cache
def _segment_program(options: tuple[tuple[str, Any], ...] = ()):
    """The segment program, jitted with XLA `options` (on XLA:CPU those that hold it in fewer memory maps: startup.py;
    a server keeps dozens of these programs, and a process's maps are limited)."""
    jit = functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(5, 6))
    return jit(_prefill_and_run, compiler_options=dict(options)) if options else jit(_prefill_and_run)


def _lazy_segment(loop, cfg, window, params, state, pool, tables, cycles):
    """Cycles over the window on a state with a lazy drafter. The target states plain cycles keep (`aux_BSI`) go into
    the window whole (its rows are the state's first rows): plain cycles write them in place, a chain's catch-up reads
    them, and neither slices a window of them out and puts it back (that took 3% of a 1-row plain segment of the
    bundled pair on the CPU, the slice alone 3% of a 4-row chain segment's profiled self time at 1,024 positions). A
    plain segment also leaves the drafter's fields out of the window: nothing of them to slice and put back."""
    state, aside = state.set_aside(*(() if cfg.num_steps else DRAFTER_ONLY), "aux_BSI")
    part = _gather(state, pool, tables, jnp.int32(0), *window).replace(aux_BSI=aside["aux_BSI"])
    part = loop.run(cfg, *params, part, cycles)
    state, pool = _scatter(state, pool, part.replace(aux_BSI=None), jnp.int32(0))
    return state.replace(**aside | {"aux_BSI": part.aux_BSI}), pool


_greedy_q_repaired = jax.jit(LoopState.greedy_q_repaired)
