"""Time each phase of a speculative cycle alone, as separately compiled programs on representative states.

Each phase runs `inner` times inside one compiled `fori_loop` whose carry feeds its output back in (so nothing is
loop-invariant and per-call dispatch is amortised), with warm-up calls first and the median over `reps` calls.
The phases are the functions `jaxspec.decoding.spec_loop` composes per cycle: a drafter step, verify of T = k+1 tokens
(capturing the drafter's target layers), draft-extend over T tokens, the accept/commit/counter bookkeeping, and a plain
decode step (k = 0's verify); for tree drafts (a `DraftShape` with topk > 1), the whole tree draft, verify of the
tree's nodes under its mask, and the tree's bookkeeping (node selection, path acceptance, commit, cache compaction,
counters). Each method takes what its phase's cost depends on: a token count, or the tree's shape. Each phase
compiles once per `PhaseTimer` and keeps its state, so it can be re-timed cheaply many times (the tuner times the
phases after every few cycles of the real loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxspec.decoding import tree
from jaxspec.decoding.draft_shape import DraftShape
from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.spec_loop import (
    LoopConfig,
    LoopState,
    accept_commit,
    commit,
    count_acceptance,
    draft_extend,
    draft_step,
    draft_tree,
    target_forward,
)
from jaxspec.runtime import Drafter, Target
from sharding.multihost import put_global


def median_seconds(fn: Callable[..., Any], state: tuple, *, warmup: int = 1, reps: int = 5) -> float:
    """Median wall seconds of `state = fn(*state)` (blocking on the result). The first `warmup` calls (which
    compile) are not counted. `fn` must return a new state of the same structure (buffers may be donated)."""
    if reps < 1:
        raise ValueError(f"reps: expected >= 1, got {reps}")
    for _ in range(warmup):
        state = jax.block_until_ready(fn(*state))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        state = jax.block_until_ready(fn(*state))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def alternating_seconds(fns: dict[str, Callable[..., Any]], args: tuple, *, calls: int, round_index: int) -> dict:
    """One round of an A/B in one process: each of `fns` called `calls` times on `args` (blocking once after its
    calls), in the dict's order in even rounds and reversed in odd ones, so a drift of the machine falls on each
    alike. Returns {name: wall seconds per call}."""
    if calls < 1:
        raise ValueError(f"calls: expected >= 1, got {calls}")
    names = list(fns) if round_index % 2 == 0 else list(fns)[::-1]
    seconds = {}
    for name in names:
        start = time.perf_counter()
        for _ in range(calls):
            out = fns[name](*args)
        jax.block_until_ready(out)
        seconds[name] = (time.perf_counter() - start) / calls
    return {name: seconds[name] for name in fns}


class PhaseTimer:
    """Compiles and times the phases of one (target, drafter) pair at a batch size and cache length."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter,
        *,
        batch: int,
        cache_len: int,
        context: int | None = None,
        inner: int = 8,
    ):
        if batch % target.mesh.shape["data"]:
            raise ValueError(f"batch {batch} is not divisible by the mesh's data axis ({target.mesh.shape['data']})")
        self.target, self.drafter = target, drafter
        self.batch, self.cache_len, self.inner = batch, cache_len, inner
        self.context = cache_len // 2 if context is None else context
        self.greedy = Sampling()
        self.rep = NamedSharding(target.mesh, PartitionSpec())
        self.key = put_global(jax.random.key(0), self.rep)
        self._programs: dict[tuple, list] = {}  # phase key -> [compiled, fixed args, carry]

    def _put(self, x) -> jax.Array:
        return put_global(x, self.rep)  # the mesh may span several processes

    def _ids(self, tokens: int) -> jax.Array:
        rng = np.random.default_rng(tokens)
        return self._put(rng.integers(0, self.target.vocab_size, (self.batch, tokens), dtype=np.int32))

    def _pos(self, tokens: int) -> jax.Array:
        if self.context + tokens > self.cache_len:
            raise ValueError(f"context {self.context} + {tokens} tokens exceeds the cache of {self.cache_len}")
        pos = self.context + np.arange(tokens, dtype=np.int32)
        return self._put(np.broadcast_to(pos, (self.batch, tokens)).copy())

    def _time(self, key, build: Callable[[], tuple[Callable, tuple, tuple]], *, warmup: int, reps: int) -> float:
        """Seconds per phase call. `build()` -> (body, fixed, carry) runs once per `key`; the compiled program and its
        (donated, fed back) carry are kept, so repeated calls re-time without recompiling or re-allocating."""
        if key not in self._programs:
            body, fixed, carry = build()
            inner = self.inner

            def program(fixed, carry):
                return jax.lax.fori_loop(0, inner, lambda _, c: body(*fixed, *c), carry)

            self._programs[key] = [jax.jit(program, donate_argnums=1), fixed, carry]
            warmup = max(warmup, 1)  # the first call compiles
        entry = self._programs[key]
        compiled, fixed = entry[0], entry[1]

        def step(*carry):
            entry[2] = compiled(fixed, carry)
            return entry[2]

        return median_seconds(step, tuple(entry[2]), warmup=warmup, reps=reps) / self.inner

    def decode(self, *, warmup: int = 1, reps: int = 5) -> float:
        """One plain decode step: target forward of 1 token, greedy head, no capture."""
        target = self.target

        def body(params, pos, tokens, cache):
            out, cache, _ = target_forward(target, params, tokens, pos, cache, greedy=True)
            return out, cache

        def build():
            carry = (self._ids(1), target.init_cache(self.batch, self.cache_len))
            return body, (target.params, self._pos(1)), carry

        return self._time(("decode",), build, warmup=warmup, reps=reps)

    def verify(self, tokens: int, *, warmup: int = 1, reps: int = 5) -> float:
        """Target verify of `tokens` (= k+1) tokens, capturing the drafter's layers, greedy head."""
        target, capture = self.target, self.drafter.capture_layers

        def body(params, pos, tokens_BT, cache):
            out, cache, captured = target_forward(target, params, tokens_BT, pos, cache, capture=capture, greedy=True)
            # Keep the capture alive (the loop feeds it to draft-extend) without changing the tokens.
            nudge = (jnp.sum(captured[:, :, :1, :1]) * 0).astype(jnp.int32)
            return out + nudge, cache

        def build():
            carry = (self._ids(tokens), target.init_cache(self.batch, self.cache_len))
            return body, (target.params, self._pos(tokens)), carry

        return self._time(("verify", tokens), build, warmup=warmup, reps=reps)

    def tree_verify(self, tokens: int, *, warmup: int = 1, reps: int = 5) -> float:
        """Target verify of a draft tree of `tokens` nodes (the root included) under its ancestor mask, capturing the
        drafter's layers, greedy head. The tree is the complete binary one (node t's parent is (t - 1) // 2); the
        cost depends on the node count, not the shape."""
        target, capture = self.target, self.drafter.capture_layers
        self._pos(tokens)  # the tree's nodes take cache slots context..context + tokens - 1
        parent = np.arange(tokens) - 1 >> 1
        depth = np.array([0 if t == 0 else int(np.log2(t + 1)) for t in range(tokens)], np.int32)
        mask = np.eye(tokens, dtype=bool)
        for t in range(1, tokens):
            mask[t] |= mask[parent[t]]
        mask_BTS = self._put(np.broadcast_to(mask, (self.batch, tokens, tokens)).copy())
        pos_BT = self._put(np.broadcast_to(self.context + depth, (self.batch, tokens)).copy())

        def body(params, pos, mask, tokens_BT, cache):
            out, cache, captured = target_forward(
                target, params, tokens_BT, pos, cache, capture=capture, greedy=True, tree_mask_BTS=mask
            )
            nudge = (jnp.sum(captured[:, :, :1, :1]) * 0).astype(jnp.int32)
            return out + nudge, cache

        def build():
            carry = (self._ids(tokens), target.init_cache(self.batch, self.cache_len))
            return body, (target.params, pos_BT, mask_BTS), carry

        return self._time(("tree_verify", tokens), build, warmup=warmup, reps=reps)

    def _tree_draft_inputs(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(root logits [B, U], drafter h2 [B, D], prefix lengths [B]) of a tree draft at the timer's context."""
        cfg = self.drafter.config
        rng = np.random.default_rng(3)
        root = self._put(rng.standard_normal((self.batch, cfg.draft_vocab_size)).astype(np.float32))
        hidden = self._put(jnp.zeros((self.batch, cfg.hidden_size), self.drafter.dtype) + 0.01)
        return root, hidden, self._put(np.full((self.batch,), self.context, np.int32))

    def tree_draft(self, shape: DraftShape, *, warmup: int = 1, reps: int = 5) -> float:
        """A tree's whole draft (`spec_loop.draft_tree`): the root's top-`topk` children, then `num_steps` - 1 drafter
        steps over the `topk` frontier nodes, each expanding it (its cost depends on num_steps and topk)."""
        drafter, num_steps, topk = self.drafter, shape.num_steps, shape.topk

        def body(params, hidden_BD, n_B, cache, root_BU):
            draft = draft_tree(drafter, params, root_BU, hidden_BD, n_B, cache, num_steps, topk)
            return (root_BU + jnp.sum(draft.scores) * 0,)

        def build():
            root, hidden, n_B = self._tree_draft_inputs()
            cache = drafter.init_cache(self.batch, self.cache_len)
            return body, (drafter.params, hidden, n_B, cache), (root,)

        return self._time(("tree_draft", num_steps, topk), build, warmup=warmup, reps=reps)

    def tree_bookkeeping(self, shape: DraftShape, *, warmup: int = 1, reps: int = 5) -> float:
        """A greedy tree cycle's work outside the model calls: keep the verify_tokens - 1 best candidates
        (`tree.finish`), accept the longest matching path, commit it, compact it in the target cache and count (a
        tree's "other" phase)."""
        target, drafter, B, S = self.target, self.drafter, self.batch, self.cache_len
        num_steps, topk, tokens = shape.num_steps, shape.topk, shape.verify_tokens
        if self.context + num_steps + 2 > S:
            raise ValueError(f"tree_bookkeeping: context {self.context} + {num_steps + 2} does not fit a buffer of {S}")
        cfg = LoopConfig(shape, self.greedy, tuple(target.config.stop_token_ids), self.context, self.context)

        def body(draft, out_BT, s):
            n_B = s.length_B
            pending_B = jnp.take_along_axis(s.tokens_BS, n_B[:, None], axis=1)[:, 0]
            nodes = tree.finish(draft, pending_B, n_B, tokens)
            path, accepted_B, next_B = tree.greedy_accept_tree(nodes, out_BT)
            path_BJ = jnp.take_along_axis(nodes.tokens_BT, path[:, 1:], axis=1)
            _, active_B, c = commit(cfg, s, path_BJ, accepted_B, next_B)
            tcache = target.compact_cache(s.target_cache, n_B, path, jnp.where(active_B, accepted_B, 0))
            counts = count_acceptance(num_steps, s, accepted_B, active_B)
            # Stay at the timer's context however long it runs (the lengths are fed back).
            return (c.replace(target_cache=tcache, end_B=s.end_B, length_B=s.length_B, **counts),)

        def build():
            root, hidden, n_B = self._tree_draft_inputs()
            cache = drafter.init_cache(B, S)
            draft = jax.jit(draft_tree, static_argnums=(0, 6, 7))(
                drafter, drafter.params, root, hidden, n_B, cache, num_steps, topk
            )
            state = self._loop_state(shape, self.context)
            return body, (draft, self._ids(tokens)), (state,)

        return self._time(("tree_bookkeeping", shape), build, warmup=warmup, reps=reps)

    def draft_step(self, *, warmup: int = 1, reps: int = 5) -> float:
        """One drafter step (1 token from the previous h2) and its greedy draft token choice."""
        drafter = self.drafter

        def body(params, pos, token_B, hidden_BD, cache):
            ids_B, _, h2_BD, cache = draft_step(drafter, params, token_B, hidden_BD, pos, cache, self.key, self.greedy)
            return ids_B, h2_BD.astype(hidden_BD.dtype), cache

        def build():
            hidden = self._put(jnp.zeros((self.batch, drafter.config.hidden_size), drafter.dtype) + 0.01)
            carry = (self._ids(1)[:, 0], hidden, drafter.init_cache(self.batch, self.cache_len))
            return body, (drafter.params, self._pos(1)), carry

        return self._time(("draft",), build, warmup=warmup, reps=reps)

    def extend(self, tokens: int, *, warmup: int = 1, reps: int = 5) -> float:
        """Draft-extend over `tokens` (= k+1) tokens with captured target states, then the next first draft."""
        drafter, cfg = self.drafter, self.drafter.config
        width = len(drafter.capture_layers) * cfg.target_hidden_size

        def body(params, pos, pick_B, tokens_BT, aux_BTI, cache):
            draft_B, _, h2_BD, cache = draft_extend(
                drafter, params, tokens_BT, aux_BTI, pos, cache, pick_B, self.key, self.greedy
            )
            tokens_BT = tokens_BT.at[:, 0].set(draft_B)
            aux_BTI = aux_BTI + (jnp.sum(h2_BD) * 0).astype(aux_BTI.dtype)
            return tokens_BT, aux_BTI, cache

        def build():
            rng = np.random.default_rng(1)
            aux = self._put(jnp.asarray(rng.standard_normal((self.batch, tokens, width)), drafter.target.dtype))
            carry = (self._ids(tokens), aux, drafter.init_cache(self.batch, self.cache_len))
            pick_B = self._put(np.full((self.batch,), tokens - 1, np.int32))
            return body, (drafter.params, self._pos(tokens), pick_B), carry

        return self._time(("extend", tokens), build, warmup=warmup, reps=reps)

    def bookkeeping(self, tokens: int, *, warmup: int = 1, reps: int = 5) -> float:
        """The loop's work outside the model calls in a greedy cycle verifying `tokens` (= k+1) tokens: accept,
        commit (token buffer, lengths, stop and budget checks) and the acceptance counters (the model's t_other)."""
        J, B, S = tokens - 1, self.batch, self.cache_len
        if tokens + 2 > S:
            raise ValueError(f"bookkeeping: {tokens} tokens do not fit a buffer of {S}")
        chain = DraftShape(J)
        cfg = LoopConfig(chain, self.greedy, tuple(self.target.config.stop_token_ids), self.context, self.context)

        def body(draft_BJ, out_BT, s):
            accepted_B, _, active_B, c = accept_commit(cfg, s, draft_BJ, [], out_BT, self.key)
            wrap = lambda x: 1 + (x - 1) % (S - tokens - 2)  # stay inside the buffer however long it runs
            counts = count_acceptance(J, s, accepted_B, active_B)
            return (c.replace(end_B=wrap(c.end_B), length_B=wrap(c.length_B), **counts),)

        def build():
            # The chain's bookkeeping never reads the target cache: a placeholder stands in for it in the carry.
            state = self._loop_state(chain, min(self.context, S - tokens - 2))
            state = state.replace(target_cache=self._put(np.zeros((B,), np.int32)))
            return body, (self._ids(J), self._ids(J + 1)), (state,)

        return self._time(("bookkeeping", tokens), build, warmup=warmup, reps=reps)

    def _loop_state(self, draft: DraftShape, length: int) -> LoopState:
        """A loop state of the timer's batch with every row running at `length` processed positions over random
        tokens, for the bookkeeping phases (no drafter cache: they do not use it)."""
        B, S = self.batch, self.cache_len
        empty = LoopState.empty(self.target, None, draft, B, S, seed=1)
        lengths = self._put(np.full((B,), length, np.int32))
        return empty.replace(
            tokens_BS=self._put(np.random.default_rng(2).integers(0, self.target.vocab_size, (B, S), np.int32)),
            length_B=lengths,
            end_B=lengths + 1,
            max_new_B=self._put(np.full((B,), S, np.int32)),
            done_B=self._put(np.zeros((B,), bool)),
        )
