"""Temperature, top-k and top-p as pure, jittable functions on logits [..., V] (the `Sampling` value they apply
lives in sampling_params.py, plain Python, and is re-exported here).

The target's p and the drafter's q both go through `warp` with the same `Sampling`: speculative sampling is lossless
with respect to whatever distribution the target's logits are warped into, so the two must be warped identically.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.decoding.sampling_params import Sampling
from sharding.collectives import first_argmax


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
        return first_argmax(logits)
    return jax.random.categorical(key, warp(logits, sampling), axis=-1).astype(jnp.int32)


@struct.dataclass
class RowSampling:
    """Per-row sampling settings as arrays [B], so requests with different settings share one compiled program.

    Row b is greedy where temperature_B[b] == 0; top_k_B 0 and top_p_B 1 turn those filters off (as in `Sampling`).
    `greedy` is False: the program as a whole samples (greedy rows become point masses inside `warp_rows`).
    """

    temperature_B: jax.Array  # float32
    top_k_B: jax.Array  # int32
    top_p_B: jax.Array  # float32
    greedy = False  # not a field: the static "whole batch is greedy" flag `Sampling` has

    @classmethod
    def of(cls, settings: list[Sampling]) -> RowSampling:
        """Host arrays for a list of per-row `Sampling`s (validated there)."""
        return cls(
            np.asarray([s.temperature for s in settings], np.float32),
            np.asarray([s.top_k for s in settings], np.int32),
            np.asarray([s.top_p for s in settings], np.float32),
        )


def warp_rows(logits: jax.Array, rows: RowSampling) -> jax.Array:
    """`warp` with each row's own settings: log-probabilities [B, ..., V] for logits [B, ..., V].

    Row b equals `warp(logits[b], Sampling(temperature_B[b], top_k_B[b], top_p_B[b]))` up to float rounding. The max
    is subtracted before dividing by the temperature, so tiny temperatures give a point mass, never NaN. The sort that
    top-k / top-p need only runs when some row uses them.
    """
    logits = logits.astype(jnp.float32)
    expand = lambda x: x.reshape(x.shape + (1,) * (logits.ndim - 1))  # [B] -> [B, 1, ..., 1]
    temp, top_k, top_p = expand(rows.temperature_B), expand(rows.top_k_B), expand(rows.top_p_B)
    greedy = temp == 0
    scaled = (logits - logits.max(-1, keepdims=True)) / jnp.where(greedy, 1.0, temp)
    filtered = (rows.top_k_B > 0) | (rows.top_p_B < 1)
    scaled = jax.lax.cond(
        jnp.any(filtered & (rows.temperature_B > 0)),
        lambda x: jnp.where(_keep_rows(x, top_k, top_p), x, -jnp.inf),
        lambda x: x,
        scaled,
    )
    argmax = jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=bool)
    return jnp.where(greedy, jnp.where(argmax, 0.0, -jnp.inf), jax.nn.log_softmax(scaled, axis=-1))


def _keep_rows(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Boolean mask [..., V] of the tokens each row's top-k and top-p keep (the order of `_keep`)."""
    vocab = scaled.shape[-1]
    # A stable descending sort ranks ties towards the lower token id, as lax.top_k does in `_keep`.
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    keep = jnp.arange(vocab) < jnp.where(top_k > 0, top_k, vocab)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs < top_p) | (top_p >= 1)
    return jnp.put_along_axis(jnp.zeros(scaled.shape, bool), order, keep, axis=-1, inplace=False)


def sample_rows(key_B: jax.Array, logits: jax.Array, rows: RowSampling) -> jax.Array:
    """Token ids [B, ...] drawn from warp_rows(logits), row b with its own key key_B[b] (argmax where greedy). Where
    every row is greedy no noise is drawn (a `lax.cond`: the draw's Gumbel noise over the vocabulary was 3% of a
    serving prefill chunk's time on the bundled pair, for a one-hot whose draw is its argmax)."""

    def draw():
        warped = warp_rows(logits, rows)
        return jax.vmap(lambda k, lp: jax.random.categorical(k, lp, axis=-1))(key_B, warped).astype(jnp.int32)

    greedy = lambda: first_argmax(logits)  # warp_rows' one-hot: the first maximum
    return jax.lax.cond(jnp.any(rows.temperature_B > 0), draw, greedy)
