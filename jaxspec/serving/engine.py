"""The serving engine: continuous batching over a fixed set of slots, the batch B of one compiled draft-verify loop.

One engine step (see `Engine.step`):
1. cancellations: a cancelled or externally finished request leaves its slot at once (its row is marked done);
2. admission: queued requests take free slots; admitting writes only that row's prompt, budget, sampling settings,
   stop ids and seed (`_admit`, one small compiled program);
3. prefill: every slot still prefilling runs ONE chunk of its prompt into its own cache rows
   (`SpecLoop.prefill_slot`); running rows keep their state, so a long prompt never stalls the others for long;
4. a segment: `segment_cycles` cycles of the compiled loop (`SpecLoop.run`; rows that are free, prefilling or
   finished are done and only ride along) over the smallest compiled window of rows and positions covering every
   busy row, as the static-greedy program while every busy row is greedy, else the per-row one;
5. collection: new tokens go to their requests; a finished row frees its slot immediately.
Every program has fixed shapes (B slots, S context positions, C prefill chunk), so nothing recompiles after warm-up.
Sampling settings, seeds and stop ids are per-row arrays (`LoopConfig.sampling=None`), so greedy and sampled requests
share a batch; each row draws from its own key, so a request's output never depends on what else is in the batch.
With `topk` > 1 every cycle drafts a tree (decoding/tree.py): the same steps, a tree cycle inside the segment.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.decoding.generate import check_tree
from jaxspec.decoding.sampling import RowSampling, Sampling
from jaxspec.decoding.spec_loop import LoopConfig, LoopState, SpecLoop
from jaxspec.serving.plan import MAX_STOP_IDS
from jaxspec.serving.scheduler import QueueFull, Request, Slot

log = logging.getLogger("jaxspec.serving")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static shape of the engine: each field is part of the compiled programs."""

    max_batch: int = 8  # B: slots
    max_context: int = 1024  # S: positions per slot (prompt + generated + draft lookahead)
    num_steps: int = 3  # J: draft tokens per cycle (0 = plain decoding); with topk > 1 the tree's depth
    topk: int = 1  # > 1: tree drafts with topk children per frontier node (decoding/tree.py)
    num_draft_tokens: int | None = None  # trees: nodes verified per cycle, the root included (None: every candidate)
    prefill_chunk: int = 64  # C: prompt tokens per prefill call
    segment_cycles: int = 4  # cycles per segment (admission and streaming happen between segments)
    max_queue: int = 64  # requests waiting for a slot before new ones get QueueFull
    # Compiled segment batches: a segment runs only rows [0, b) for the smallest b covering every generating row
    # (free slots are taken lowest first), so one request does not pay for B rows. () = powers of two up to B.
    batch_buckets: tuple[int, ...] = ()
    # Compiled segment contexts: a segment runs only positions [0, s) for the smallest s covering what every occupied
    # row can reach in it, so attention and cache traffic follow the live lengths, not max_context.
    # () = powers of two from 256 up to max_context (and max_context itself). Each bucket compiles its own segment
    # programs (batch buckets x context buckets x the greedy and per-row programs), so startup takes longer.
    context_buckets: tuple[int, ...] = ()
    # While every occupied row is greedy, segments run the static-greedy program (argmax head, no per-row warping
    # or sampling); its tokens are the per-row program's for greedy rows. False: always the per-row program.
    greedy_program: bool = True

    @property
    def tree(self) -> bool:
        return self.topk > 1

    @property
    def verify_tokens(self) -> int:
        """Tokens one verify step takes: num_steps + 1 for a chain, num_draft_tokens for a tree."""
        return check_tree(self.num_steps, self.topk, self.num_draft_tokens, None)

    @property
    def lookahead(self) -> int:
        """Cache slots past a row's committed length that one cycle may write (verify, draft-extend)."""
        return max(self.num_steps + 1, self.verify_tokens)

    @property
    def buckets(self) -> tuple[int, ...]:
        if self.batch_buckets:
            return tuple(sorted(set(self.batch_buckets) | {self.max_batch}))
        return tuple(sorted({min(1 << i, self.max_batch) for i in range(self.max_batch.bit_length() + 1)}))

    @property
    def contexts(self) -> tuple[int, ...]:
        if self.context_buckets:
            return tuple(sorted(set(self.context_buckets) | {self.max_context}))
        return tuple(sorted({min(256 << i, self.max_context) for i in range(self.max_context.bit_length())}))

    def __post_init__(self):
        for name in ("max_batch", "max_context", "prefill_chunk", "segment_cycles"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name}: expected an integer >= 1, got {value!r}")
        if not isinstance(self.num_steps, int) or not 0 <= self.num_steps <= 16:
            raise ValueError(f"EngineConfig.num_steps: expected an integer in [0, 16], got {self.num_steps!r}")
        try:
            self.verify_tokens  # noqa: B018  (validates topk and num_draft_tokens against num_steps)
        except ValueError as e:
            raise ValueError(f"EngineConfig.{e}") from None
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ValueError(f"EngineConfig.max_queue: expected an integer >= 0, got {self.max_queue!r}")
        if any(not isinstance(b, int) or not 1 <= b <= self.max_batch for b in self.batch_buckets):
            raise ValueError(
                f"EngineConfig.batch_buckets: expected sizes in [1, {self.max_batch}], got {self.batch_buckets}"
            )
        if any(not isinstance(s, int) or not 1 <= s <= self.max_context for s in self.context_buckets):
            raise ValueError(
                f"EngineConfig.context_buckets: expected sizes in [1, {self.max_context}], got {self.context_buckets}"
            )
        if self.max_context % self.prefill_chunk:
            raise ValueError(
                f"EngineConfig.max_context ({self.max_context}) must be a multiple of prefill_chunk "
                f"({self.prefill_chunk})"
            )


class Engine:
    """Continuous batching with speculative decoding. Drive it with `start()` (a background thread) or call `step()`
    yourself (tests). `submit` and `cancel` are thread-safe."""

    def __init__(self, target, drafter, config: EngineConfig = EngineConfig(), *, stop_ids=(), metrics=None):
        if config.num_steps and drafter is None:
            raise ValueError(f"num_steps={config.num_steps} needs a drafter (pass num_steps=0 for plain decoding)")
        if config.tree and drafter is not None:
            check_tree(config.num_steps, config.topk, config.num_draft_tokens, drafter)  # topk within its vocabulary
        if target.mesh.shape.get("data", 1) != 1:
            raise ValueError("serving: the mesh's data axis must be 1 (slots are prefilled one row at a time)")
        if config.max_context > target.config.max_position_embeddings:
            raise ValueError(
                f"EngineConfig.max_context {config.max_context} exceeds the model's context of "
                f"{target.config.max_position_embeddings} positions"
            )
        self.target, self.config, self.metrics = target, config, metrics
        self.drafter = drafter if config.num_steps else None
        self.stop_ids = tuple(sorted(set(target.config.stop_token_ids) | set(stop_ids)))
        self.loop = SpecLoop(target, self.drafter)
        chunk = config.prefill_chunk
        tree = dict(topk=config.topk, num_draft_tokens=config.verify_tokens if config.tree else 0)
        self.loop_cfg = LoopConfig(config.num_steps, None, self.stop_ids, chunk, chunk, **tree)
        self.greedy_cfg = dataclasses.replace(self.loop_cfg, sampling=Sampling())
        # Chains only: the static-greedy program leaves a placeholder in greedy rows' draft_q_BV, which a per-row
        # segment must replace first (`_fix_greedy_q`). Trees keep the root's logits there (tree acceptance reads
        # only the target), so there is nothing to fix.
        self._greedy_leaves_q = bool(config.num_steps) and not config.tree
        self._q_stale = False  # greedy segments left greedy rows' draft_q as the greedy program's placeholder
        self._admit = jax.jit(_admit, donate_argnums=0)
        self._finish = jax.jit(lambda done_B, slot: done_B.at[slot].set(True), donate_argnums=0)
        self.state = self._empty_state()
        self.slots: list[Slot | None] = [None] * config.max_batch
        self._queue: collections.deque[Request] = collections.deque()
        self._cancels: list[tuple[Request, str]] = []
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._counters = None  # last (cycles, reached, accepted, hist) read from the state, for metric deltas

    # ------------------------------------------------------------------ public, thread-safe
    def check(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a request does not fit a slot (None if it does)."""
        cfg = self.config
        need = prompt_len + max_tokens + cfg.lookahead + 1
        chunked = -(-prompt_len // cfg.prefill_chunk) * cfg.prefill_chunk + 1
        if max(need, chunked) > cfg.max_context:
            return (
                f"prompt of {prompt_len} tokens + max_tokens {max_tokens} (+ {cfg.lookahead + 1} for drafting) "
                f"exceeds the context of {cfg.max_context} positions per slot"
            )
        return None

    def submit(self, request: Request) -> None:
        """Queue a request (validated: prompt ids in the vocabulary, fits the context). Raises QueueFull."""
        vocab = self.target.vocab_size
        if not request.prompt or min(request.prompt) < 0 or max(request.prompt) >= vocab:
            raise ValueError(f"prompt: expected a non-empty list of token ids in [0, {vocab})")
        if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an integer >= 1, got {request.max_tokens!r}")
        if len(request.stop_ids) > MAX_STOP_IDS or any(not 0 <= t < vocab for t in request.stop_ids):
            raise ValueError(f"stop ids: expected at most {MAX_STOP_IDS} token ids in [0, {vocab})")
        problem = self.check(len(request.prompt), request.max_tokens)
        if problem:
            raise ValueError(problem)
        with self._lock:
            if len(self._queue) >= self.config.max_queue:
                raise QueueFull(f"the queue holds {self.config.max_queue} waiting requests; retry later")
            request.arrival = time.perf_counter()
            self._queue.append(request)
            self._lock.notify()
            if self.metrics is not None:
                # Only the queue depth: the occupancy gauge is the engine thread's. Setting it from here raced with
                # an admission and could leave a stale 0 standing while a slot was already held.
                self.metrics.queue_depth.set(len(self._queue))

    def cancel(self, request: Request, reason: str = "cancelled") -> None:
        """Finish `request` now (client gone, or a stop string seen by the caller); its slot is freed next step."""
        with self._lock:
            self._cancels.append((request, reason))
            self._lock.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def occupancy(self) -> int:
        """Slots holding a request (prefilling or generating)."""
        return sum(s is not None for s in self.slots)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="jaxspec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the background thread after its current step (requests still running are finished as cancelled)."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            queued, self._queue = list(self._queue), collections.deque()
        for r in [s.request for s in self.slots if s is not None] + queued:
            self._done(r, "cancelled")

    # ------------------------------------------------------------------ the step
    def step(self) -> bool:
        """One round of cancel / admit / prefill / segment / collect. Returns False when there was nothing to do."""
        self._apply_cancels()
        self._admit_queued()
        prefilling = [i for i, s in enumerate(self.slots) if s is not None and s.next_chunk is not None]
        running = [i for i, s in enumerate(self.slots) if s is not None and s.next_chunk is None]
        if not prefilling and not running:
            return False
        for i in prefilling:
            self._prefill_chunk(i)
        if running:
            self._segment(max(running) + 1, self._context_need())
        self._collect()
        return True

    def run_until_idle(self) -> None:
        """Step until every submitted request has finished (in the calling thread)."""
        while self.step():
            pass

    def warmup(self, on_progress: Callable[[str], None] = log.info) -> float:
        """Compile every program the engine uses (admit, prefill chunk, segment, finish) by serving two dummy
        requests, one of them cancelled; returns the seconds taken."""
        start = time.perf_counter()
        cfg = self.config
        metrics, self.metrics = self.metrics, None  # the dummy requests are not traffic
        on_progress(
            f"compiling: {cfg.max_batch} slots x {cfg.max_context} positions, prefill chunk {cfg.prefill_chunk}, "
            f"k = {cfg.num_steps}{f', topk {cfg.topk}, {cfg.verify_tokens} draft tokens' if cfg.tree else ''}, "
            f"{cfg.segment_cycles} cycles per segment"
        )
        first = Request([1] * 3, 2 + cfg.num_steps, Sampling(1.0), seed=0)
        self.submit(first)
        self.step()  # admit + prefill + segment
        on_progress(f"  admit, prefill and segment programs compiled ({time.perf_counter() - start:.1f}s)")
        programs = (self.loop_cfg, self.greedy_cfg) if cfg.greedy_program else (self.loop_cfg,)
        for b in cfg.buckets:
            for s in cfg.contexts:
                for program in programs:
                    self._segment(b, s, program)  # the dummy request finishes in its first cycles; then no-ops
            on_progress(
                f"  segments over {b} rows x contexts {list(cfg.contexts)} x {len(programs)} programs compiled "
                f"({time.perf_counter() - start:.1f}s)"
            )
        if cfg.greedy_program and self._greedy_leaves_q:
            self.state = _fix_greedy_q(self.state)  # harmless on any state: greedy rows keep their point mass
        self.run_until_idle()
        second = Request([1] * 3, 8)
        self.submit(second)
        self.step()
        self.cancel(second)
        self.run_until_idle()
        on_progress(f"  cancel program compiled; warm-up done in {time.perf_counter() - start:.1f}s")
        self.metrics = metrics
        return time.perf_counter() - start

    # ------------------------------------------------------------------ internals
    def _params(self):
        return self.target.params, self.drafter.params if self.drafter is not None else None

    def _empty_state(self) -> LoopState:
        """All rows free (done), per-row sampling: greedy, no stop ids, keys from seed 0."""
        B, S, J = self.config.max_batch, self.config.max_context, self.config.num_steps
        rep = NamedSharding(self.target.mesh, P())
        put = lambda x: jax.device_put(x, rep)  # noqa: E731
        drafter = self.drafter
        V = self.target.vocab_size if drafter is not None else 1
        if self.config.tree:  # a tree's draft_q_BV holds the drafter's logits at the next root
            V = drafter.config.draft_vocab_size
        D = drafter.config.hidden_size if drafter is not None else 1
        zeros = lambda: put(np.zeros((B,), np.int32))  # noqa: E731  (separate buffers: the programs donate them)
        return LoopState(
            tokens_BS=put(np.zeros((B, S), np.int32)),
            prompt_len_B=zeros() + 1,
            length_B=zeros(),
            end_B=zeros() + 1,
            max_new_B=zeros() + 1,
            done_B=put(np.ones((B,), bool)),
            target_cache=self.target.init_cache(B, S),
            draft_cache=drafter.init_cache(B, S) if drafter is not None else None,
            draft_B=zeros(),
            draft_q_BV=put(np.zeros((B, V), np.float32)),
            hidden_BD=put(np.zeros((B, D), drafter.dtype if drafter is not None else np.float32)),
            key=put(jax.random.split(jax.random.key(0), B)),
            cycles=put(np.zeros((), np.int32)),
            reached_J=put(np.zeros((J,), np.int32)),
            accepted_J=put(np.zeros((J,), np.int32)),
            accept_hist_T=put(np.zeros((J + 1,), np.int32)),
            row_sampling=jax.tree.map(put, RowSampling.of([Sampling()] * B)),
            stop_ids=put(np.full((B, MAX_STOP_IDS), -1, np.int32)),
        )

    def _apply_cancels(self) -> None:
        with self._lock:
            cancels, self._cancels = self._cancels, []
            for request, _ in cancels:
                if request in self._queue:
                    self._queue.remove(request)
        for request, reason in cancels:
            if request.finished:
                continue
            if request.slot is not None:
                self.state = self.state.replace(done_B=self._finish(self.state.done_B, request.slot))
                self.slots[request.slot] = None
            self._done(request, reason)

    def _admit_queued(self) -> None:
        while None in self.slots:
            with self._lock:
                if not self._queue:
                    break
                request = self._queue.popleft()
            slot = self.slots.index(None)
            S = self.config.max_context
            tokens = np.zeros((S,), np.int32)
            tokens[: len(request.prompt)] = request.prompt
            stop = np.full((MAX_STOP_IDS,), -1, np.int32)
            stop[: len(request.stop_ids)] = request.stop_ids
            s = request.sampling
            seed = request.seed if request.seed is not None else secrets.randbits(32)
            row = (tokens, len(request.prompt), request.max_tokens, s.temperature, s.top_k, s.top_p, stop, seed)
            row = tuple(np.asarray(x, dt) for x, dt in zip(row, _ROW_DTYPES, strict=True))
            self.state = self._admit(self.state, np.int32(slot), *row)
            request.slot = slot
            self.slots[slot] = Slot(request, 0)
        self._gauges()

    def _segment(self, rows: int, positions: int, program: LoopConfig | None = None) -> None:
        """`segment_cycles` cycles over the rows [0, b) and positions [0, s) of the smallest buckets b >= rows and
        s >= positions, with `program` (default: `_program()`)."""
        config = self.config
        b = next(b for b in config.buckets if b >= rows)
        s = next(s for s in config.contexts if s >= positions)
        program = program or self._program()
        if program is self.greedy_cfg:
            self._q_stale = self._greedy_leaves_q
        elif self._q_stale:
            self.state = _fix_greedy_q(self.state)
            self._q_stale = False
        cycles = jnp.int32(config.segment_cycles)
        if (b, s) == (config.max_batch, config.max_context):
            self.state = self.loop.run(program, *self._params(), self.state, cycles)
            return
        part = self.loop.run(program, *self._params(), _take_rows(self.state, b, s), cycles)
        self.state = _put_rows(self.state, part)

    def _program(self) -> LoopConfig:
        """The static-greedy program while every occupied row is greedy (and the config allows it), else per-row."""
        greedy = all(s is None or s.request.sampling.greedy for s in self.slots)
        return self.greedy_cfg if greedy and self.config.greedy_program else self.loop_cfg

    def _context_need(self) -> int:
        """Positions the next segment can touch: every running row's end plus what its cycles can write (capped by
        its budget), and every prefilling row's prompt plus the lookahead its riding-along cycles write (the
        drafter's cache writes clamp at the window's end, so they must stay inside it)."""
        config = self.config
        J, ahead = config.num_steps, config.lookahead
        need = 1
        for slot in self.slots:
            if slot is None:
                continue
            r = slot.request
            budget_end = len(r.prompt) + r.max_tokens + ahead + 1
            if slot.next_chunk is not None:
                need = max(need, len(r.prompt) + ahead + 1)
            else:  # +1: a row prefilled in this step has its first token, not yet collected
                end = len(r.prompt) + len(r.tokens) + 1
                need = max(need, min(end + (config.segment_cycles - 1) * (J + 1) + ahead + 1, budget_end))
        return need

    def _prefill_chunk(self, slot: int) -> None:
        s = self.slots[slot]
        start = s.next_chunk
        self.state = self.loop.prefill_slot(self.loop_cfg, *self._params(), self.state, np.int32(slot), np.int32(start))
        C = self.config.prefill_chunk
        s.next_chunk = None if len(s.request.prompt) - 1 < start + C else start + C

    def _collect(self) -> None:
        """Hand new tokens to their requests; free the slots of finished ones."""
        tokens_BS, end_B, done_B = (np.asarray(x) for x in (self.state.tokens_BS, self.state.end_B, self.state.done_B))
        now = time.perf_counter()
        for i, s in enumerate(self.slots):
            if s is None or s.next_chunk is not None:
                continue
            r = s.request
            start = len(r.prompt) + len(r.tokens)
            new = tokens_BS[i, start : end_B[i]].tolist()
            if new:
                self._record_latency(r, len(new), now)
                r.tokens.extend(new)
                if self.metrics is not None:
                    self.metrics.observe_tokens(len(new))
            if done_B[i]:
                self.slots[i] = None
                self._done(r, "stop" if r.tokens and r.tokens[-1] in self.stop_ids + r.stop_ids else "length", new)
            elif new:
                self._notify(r, new)
        self._read_counters()
        self._gauges()

    def _done(self, request: Request, reason: str, new: list[int] | None = None) -> None:
        request.finish_reason, request.slot = reason, None
        if self.metrics is not None:
            self.metrics.requests.labels(reason).inc()
        self._notify(request, new or [])

    @staticmethod
    def _notify(request: Request, new: list[int]) -> None:
        if request.on_update is None:
            return
        try:
            request.on_update(request, new)
        except Exception:  # a consumer that went away must not stop the engine (or the other requests)
            log.exception("on_update of a request failed; ignoring")

    def _record_latency(self, r: Request, n: int, now: float) -> None:
        if self.metrics is not None:
            if r.first_token_at is None:
                self.metrics.ttft.observe(now - r.arrival)
                n -= 1
            if n > 0 and r.last_token_at is not None:
                # Tokens of one segment arrive together: each counts the mean gap since the previous arrival.
                for _ in range(n):
                    self.metrics.itl.observe((now - r.last_token_at) / n)
        r.first_token_at = r.first_token_at or now
        r.last_token_at = now

    def _read_counters(self) -> None:
        s = self.state
        counters = tuple(np.asarray(x) for x in (s.cycles, s.reached_J, s.accepted_J, s.accept_hist_T))
        if self.metrics is not None and self._counters is not None:
            self.metrics.observe_cycles(*(new - old for new, old in zip(counters, self._counters, strict=True)))
        self._counters = counters

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._queue))
            self.metrics.occupancy.set(self.occupancy)

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._queue and not self._cancels and self.occupancy == 0:
                    self._lock.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # a failed device call must not take the server down: fail what ran, start clean
                log.exception("engine step failed; failing the running requests and resetting the slots")
                for i, s in enumerate(self.slots):
                    if s is not None:
                        self.slots[i] = None
                        self._done(s.request, "error")
                self.state, self._counters = self._empty_state(), None


_ROW_DTYPES = (np.int32, np.int32, np.int32, np.float32, np.int32, np.float32, np.int32, np.uint32)


def _admit(state: LoopState, slot, tokens_S, prompt_len, max_new, temperature, top_k, top_p, stop_ids_row, seed):
    """Write one admitted request into row `slot`: prompt, budget, sampling settings, stop ids, key. The row stays
    done (cycles skip it) until its last prefill chunk; its length is the prompt length, so the positions that
    riding-along cycles overwrite lie past the prompt (and are rewritten before they are read)."""
    set_ = lambda x, v: x.at[slot].set(v)  # noqa: E731
    rows = state.row_sampling
    return state.replace(
        tokens_BS=set_(state.tokens_BS, tokens_S),
        prompt_len_B=set_(state.prompt_len_B, prompt_len),
        length_B=set_(state.length_B, prompt_len),
        end_B=set_(state.end_B, prompt_len + 1),
        max_new_B=set_(state.max_new_B, max_new),
        done_B=set_(state.done_B, True),
        key=set_(state.key, jax.random.key(seed)),
        row_sampling=RowSampling(
            set_(rows.temperature_B, temperature), set_(rows.top_k_B, top_k), set_(rows.top_p_B, top_p)
        ),
        stop_ids=set_(state.stop_ids, stop_ids_row),
    )


@jax.jit
def _fix_greedy_q(state: LoopState) -> LoopState:
    """Before a per-row segment that follows greedy ones: each greedy row's draft distribution as the per-row program
    would have left it (a point mass on its draft token; the greedy program keeps a placeholder there)."""
    q_BV = state.draft_q_BV
    point_BV = jax.nn.one_hot(state.draft_B, q_BV.shape[1], dtype=q_BV.dtype)
    greedy_B = state.row_sampling.temperature_B == 0
    return state.replace(draft_q_BV=jnp.where(greedy_B[:, None], point_BV, q_BV))


_NOT_PER_ROW = ("cycles", "reached_J", "accepted_J", "accept_hist_T")


def _row_axis(name: str) -> int | None:
    """The batch axis of a LoopState field (None: not per row)."""
    return None if name in _NOT_PER_ROW else 1 if name == "target_cache" else 0


def _position_axis(name: str) -> int | None:
    """The position (context) axis of a LoopState field (None: none)."""
    return {"tokens_BS": 1, "target_cache": 2, "draft_cache": 1}.get(name)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _take_rows(state: LoopState, b: int, s: int) -> LoopState:
    """The state of rows [0, b) and positions [0, s) (counters included) for a segment over a smaller window."""

    def take(name, x):
        a, p = _row_axis(name), _position_axis(name)
        x = x if p is None else jax.lax.slice_in_dim(x, 0, s, axis=p)
        return x if a is None else jax.lax.slice_in_dim(x, 0, b, axis=a)

    fields = dataclasses.fields(state)
    return state.replace(
        **{f.name: jax.tree.map(functools.partial(take, f.name), getattr(state, f.name)) for f in fields}
    )


@functools.partial(jax.jit, donate_argnums=0)
def _put_rows(state: LoopState, part: LoopState) -> LoopState:
    """Write a segment's window (rows [0, b), positions [0, s)) and counters back into the full state."""

    def put(name, x, y):
        return y if _row_axis(name) is None else jax.lax.dynamic_update_slice(x, y, (0,) * x.ndim)

    fields = dataclasses.fields(state)
    return state.replace(
        **{
            f.name: jax.tree.map(functools.partial(put, f.name), getattr(state, f.name), getattr(part, f.name))
            for f in fields
        }
    )
