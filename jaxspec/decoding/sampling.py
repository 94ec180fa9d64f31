"""Temperature, top-k and top-p as pure, jittable functions on logits [..., V].

The target's p and the drafter's q both go through `warp` with the same `Sampling`: speculative sampling is lossless
with respect to whatever distribution the target's logits are warped into, so the two must be warped identically.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: temperature 0 is greedy; top_k = 0 and top_p = 1 turn those filters off.

    Frozen and hashable, so it is a static argument of a jitted function (each setting compiles its own program).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        # `not x >= 0` also rejects NaN.
        if not self.temperature >= 0:
            raise ValueError(f"Sampling.temperature: expected >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise ValueError(f"Sampling.top_k: expected an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling.top_p: expected a value in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """Temperature 0: argmax decoding (top-k / top-p are then irrelevant)."""
        return self.temperature == 0


def warp(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """Log-probabilities [..., V] (float32) after temperature, then top-k, then top-p; removed tokens get -inf.

    Greedy (temperature 0) is the point mass on the argmax. top-p acts on the top-k renormalised distribution and keeps
    the smallest prefix, in descending order, whose mass reaches top_p (as HF and vLLM do).
    `jnp.exp(warp(...))` gives the p and q that `acceptance.speculative_accept` takes.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    if sampling.greedy:
        return jnp.where(jax.nn.one_hot(jnp.argmax(logits, -1), vocab, dtype=bool), 0.0, -jnp.inf)
    # Shift by the max before dividing: a tiny temperature (1e-38, or one that is 0 in float32) would otherwise turn
    # the logits into inf (NaN after softmax). The max stays exactly 0; the rest go to finite values or -inf.
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    logits = jnp.where(shifted == 0, 0.0, shifted / jnp.float32(sampling.temperature))
    top_k = min(sampling.top_k or vocab, vocab)
    if top_k < vocab or sampling.top_p < 1:
        logits = jnp.where(_keep(logits, top_k, sampling.top_p), logits, -jnp.inf)
    return jax.nn.log_softmax(logits, axis=-1)


def _keep(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Boolean mask [..., V] of the tokens top-k and top-p keep."""
    # lax.top_k ranks ties towards the lower token id, so exactly top_k survive even with tied logits (a threshold on
    # the k-th value would keep every tie); with top-k off it is the full descending sort that top-p needs.
    top_logits, top_ids = jax.lax.top_k(logits, top_k)
    keep = jnp.ones(top_logits.shape, bool)
    if top_p < 1:
        probs = jax.nn.softmax(top_logits, axis=-1)
        # Keep a token while the mass ranked above it is still short of top_p: the top token always survives.
        keep = jnp.cumsum(probs, axis=-1) - probs < top_p
    return jnp.put_along_axis(jnp.zeros(logits.shape, bool), top_ids, keep, axis=-1, inplace=False)


def sample(key: jax.Array, logits: jax.Array, sampling: Sampling) -> jax.Array:
    """Token ids [...] (int32) drawn from warp(logits); the argmax when greedy (key unused)."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, warp(logits, sampling), axis=-1).astype(jnp.int32)
