"""Time each phase of a speculative cycle alone, as separately compiled programs on representative states.

Each phase runs `inner` times inside one compiled `fori_loop` whose carry feeds its output back in (so nothing is
loop-invariant and per-call dispatch is amortised), with warm-up calls first and the median over `reps` calls.
The phases are the ones `jaxspec.decoding.spec_loop` runs per cycle: a drafter step, verify of T = k+1 tokens
(capturing the drafter's target layers), draft-extend over T tokens, and a plain decode step (k = 0's verify).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.spec_loop import SpecLoop


@dataclasses.dataclass
class PhaseTimes:
    """Median seconds per call of each phase; `t_verify` / `t_extend` map a token count to seconds."""

    t_draft: float
    t_verify: dict[int, float]
    t_extend: dict[int, float]
    t_decode: float
    batch: int
    cache_len: int
    context: int


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


class PhaseTimer:
    """Compiles and times the phases of one (target, drafter) pair at a batch size and cache length."""

    def __init__(self, target, drafter, *, batch: int, cache_len: int, context: int | None = None, inner: int = 8):
        if batch % target.mesh.shape["data"]:
            raise ValueError(f"batch {batch} is not divisible by the mesh's data axis ({target.mesh.shape['data']})")
        self.target, self.drafter = target, drafter
        self.batch, self.cache_len, self.inner = batch, cache_len, inner
        self.context = cache_len // 2 if context is None else context
        self.loop = SpecLoop(target, drafter)  # the loop's own helpers (replication, draft token choice)
        self.greedy = Sampling()
        self.rep = NamedSharding(target.mesh, P())
        self.key = jax.device_put(jax.random.key(0), self.rep)

    def _put(self, x) -> jax.Array:
        return jax.device_put(x, self.rep)

    def _ids(self, tokens: int) -> jax.Array:
        rng = np.random.default_rng(tokens)
        return self._put(rng.integers(0, self.target.vocab_size, (self.batch, tokens), dtype=np.int32))

    def _pos(self, tokens: int) -> jax.Array:
        if self.context + tokens > self.cache_len:
            raise ValueError(f"context {self.context} + {tokens} tokens exceeds the cache of {self.cache_len}")
        pos = self.context + np.arange(tokens, dtype=np.int32)
        return self._put(np.broadcast_to(pos, (self.batch, tokens)).copy())

    def _time(self, body: Callable, fixed: tuple, carry: tuple, *, warmup: int, reps: int) -> float:
        inner = self.inner

        def program(fixed, carry):
            return jax.lax.fori_loop(0, inner, lambda _, c: body(*fixed, *c), carry)

        compiled = jax.jit(program, donate_argnums=1)
        return median_seconds(lambda *c: compiled(fixed, c), carry, warmup=warmup, reps=reps) / inner

    def decode(self, *, warmup: int = 1, reps: int = 5) -> float:
        """One plain decode step: target forward of 1 token, greedy head, no capture."""
        target = self.target

        def body(params, pos, tokens, cache):
            out, cache, _ = target.apply(params, tokens, pos, cache, head="argmax")
            return self.loop._replicated(out), cache

        carry = (self._ids(1), target.init_cache(self.batch, self.cache_len))
        return self._time(body, (target.params, self._pos(1)), carry, warmup=warmup, reps=reps)

    def verify(self, tokens: int, *, warmup: int = 1, reps: int = 5) -> float:
        """Target verify of `tokens` (= k+1) tokens, capturing the drafter's layers, greedy head."""
        target, capture = self.target, self.drafter.capture_layers

        def body(params, pos, tokens_BT, cache):
            out, cache, captured = target.apply(params, tokens_BT, pos, cache, capture=capture, head="argmax")
            # Keep the capture alive (the loop feeds it to draft-extend) without changing the tokens.
            nudge = (jnp.sum(captured[:, :, :1, :1]) * 0).astype(jnp.int32)
            return self.loop._replicated(out) + nudge, cache

        carry = (self._ids(tokens), target.init_cache(self.batch, self.cache_len))
        return self._time(body, (target.params, self._pos(tokens)), carry, warmup=warmup, reps=reps)

    def draft_step(self, *, warmup: int = 1, reps: int = 5) -> float:
        """One drafter step (1 token from the previous h2) and its greedy draft token choice."""
        drafter, loop = self.drafter, self.loop

        def body(params, pos, token_B1, hidden_B1D, cache):
            logits, h2, cache = drafter.apply(params, token_B1, hidden_B1D, pos, cache, first_step=False)
            ids_B, _ = loop._draft_choose(self.key, logits[:, 0], self.greedy)
            return ids_B[:, None], loop._replicated(h2).astype(hidden_B1D.dtype), cache

        hidden = self._put(jnp.zeros((self.batch, 1, drafter.config.hidden_size), drafter.dtype) + 0.01)
        carry = (self._ids(1), hidden, drafter.init_cache(self.batch, self.cache_len))
        return self._time(body, (drafter.params, self._pos(1)), carry, warmup=warmup, reps=reps)

    def extend(self, tokens: int, *, warmup: int = 1, reps: int = 5) -> float:
        """Draft-extend over `tokens` (= k+1) tokens with captured target states, then the next first draft."""
        drafter, loop, cfg = self.drafter, self.loop, self.drafter.config
        width = len(drafter.capture_layers) * cfg.target_hidden_size
        pick_B = self._put(np.full((self.batch,), tokens - 1, np.int32))

        def body(params, pos, pick_B, tokens_BT, aux_BTX, cache):
            logits, h2, cache = drafter.apply(params, tokens_BT, aux_BTX, pos, cache, first_step=True)
            pick = lambda x: jnp.take_along_axis(loop._replicated(x), pick_B[:, None, None], axis=1)[:, 0]  # noqa: E731
            draft_B, _ = loop._draft_choose(self.key, pick(logits), self.greedy)
            tokens_BT = tokens_BT.at[:, 0].set(draft_B)
            aux_BTX = aux_BTX + (jnp.sum(pick(h2)) * 0).astype(aux_BTX.dtype)
            return tokens_BT, aux_BTX, cache

        rng = np.random.default_rng(1)
        aux = self._put(jnp.asarray(rng.standard_normal((self.batch, tokens, width)), drafter.target.dtype))
        carry = (self._ids(tokens), aux, drafter.init_cache(self.batch, self.cache_len))
        return self._time(body, (drafter.params, self._pos(tokens), pick_B), carry, warmup=warmup, reps=reps)

    def all(self, token_counts: Iterable[int], *, warmup: int = 1, reps: int = 5) -> PhaseTimes:
        """Every phase; verify and draft-extend at each of `token_counts` (k+1 for the depths k >= 1 of interest)."""
        counts = sorted(set(int(t) for t in token_counts))
        t_decode = self.decode(warmup=warmup, reps=reps)
        if self.drafter is None or not counts:
            return PhaseTimes(0.0, {}, {}, t_decode, self.batch, self.cache_len, self.context)
        return PhaseTimes(
            t_draft=self.draft_step(warmup=warmup, reps=reps),
            t_verify={t: self.verify(t, warmup=warmup, reps=reps) for t in counts},
            t_extend={t: self.extend(t, warmup=warmup, reps=reps) for t in counts},
            t_decode=t_decode,
            batch=self.batch,
            cache_len=self.cache_len,
            context=self.context,
        )


def time_phases(
    target,
    drafter,
    *,
    batch: int,
    cache_len: int,
    token_counts: Iterable[int],
    context: int | None = None,
    inner: int = 8,
    warmup: int = 1,
    reps: int = 5,
) -> PhaseTimes:
    """Median per-call seconds of every phase (see `PhaseTimer`)."""
    timer = PhaseTimer(target, drafter, batch=batch, cache_len=cache_len, context=context, inner=inner)
    return timer.all(token_counts, warmup=warmup, reps=reps)
