"""What several decoding test modules share: test drafters for the loop (a randomly initialised EAGLE-3 drafter and
an oracle that knows the target's greedy continuation, a test double with the Drafter interface), the chain tests'
prompts and budget, and the statistical checks that sampled tokens follow a distribution."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from jaxspec import KimiConfig
from jaxspec.decoding.sampling import Sampling, warp
from jaxspec.io.drafter_config import draft_config_for
from jaxspec.runtime import Drafter


def random_drafter(target, seed: int = 1) -> Drafter:
    return Drafter.random(draft_config_for(target.config), target, dtype=target.dtype, seed=seed)


class OracleDrafter:
    """Proposes ref[b, p + 2] at drafter position p: the target's own greedy token when its drafts so far were right.

    `ref_BS`: each row's prompt followed by the target's greedy continuation, at absolute positions. With
    `decoy_every` = m, at the positions p where p + 2 is a multiple of m a wrong token (ref + 1) ranks first and the
    right one second: a chain is rejected there, a tree with topk >= 2 keeps the right branch. Tree steps
    (`apply_tree`) propose by position too, so every node at depth s proposes the same children."""

    def __init__(self, target, ref_BS: np.ndarray, decoy_every: int = 0):
        self.target, self.ref, self.decoy_every = target, jnp.asarray(ref_BS, jnp.int32), decoy_every
        self.capture_layers = (0,)
        self.config = types.SimpleNamespace(hidden_size=8, draft_vocab_size=target.vocab_size)
        self.dtype, self.d2t, self.params = jnp.float32, None, {}

    def init_cache(self, batch: int, max_len: int):
        return jnp.zeros((batch,), jnp.int32)

    def init_scratch(self, batch: int, entries: int):
        return jnp.zeros((batch,), jnp.int32)

    def to_target_ids(self, ids):
        return ids

    def _logits(self, pos_BT):
        rows = pos_BT.shape[0]  # the padded batch may exceed the table's rows
        ref = jnp.pad(self.ref, ((0, max(0, rows - self.ref.shape[0])), (0, 0)))[:rows]
        nxt_BT = jnp.take_along_axis(ref, jnp.clip(pos_BT + 2, 0, ref.shape[1] - 1), axis=1)
        V = self.target.vocab_size
        if not self.decoy_every:
            return 20.0 * jax.nn.one_hot(nxt_BT, V, dtype=jnp.float32)
        decoy_BT = (pos_BT + 2) % self.decoy_every == 0
        right, wrong = jnp.where(decoy_BT, 10.0, 20.0), jnp.where(decoy_BT, 20.0, 0.0)
        one_hot = lambda t: jax.nn.one_hot(t, V, dtype=jnp.float32)
        return right[..., None] * one_hot(nxt_BT) + wrong[..., None] * one_hot((nxt_BT + 1) % V)

    def apply(self, params, tokens_BT, hidden, pos_BT, cache, *, first_step, at_B=None):
        if at_B is not None:  # `Drafter.apply`'s: the logits and h2 of position at_B only
            pos_BT = jnp.take_along_axis(pos_BT, at_B[:, None], axis=1)
        return self._logits(pos_BT), jnp.zeros((*pos_BT.shape, 8), jnp.float32), cache

    def apply_tree(self, params, tokens_BK, hidden_BKD, pos_BK, cache, scratch, write_at, mask_BKM, prefix_len_B):
        return self._logits(pos_BK), jnp.zeros((*tokens_BK.shape, 8), jnp.float32), scratch


CFG = KimiConfig.preset("tiny")
RNG = np.random.default_rng(7)
PROMPTS = {
    n: [RNG.integers(2, CFG.vocab_size, size=int(s)).tolist() for s in RNG.integers(1, 12, n)] for n in (1, 3, 8)
}
NEW = 14


def stop_mid_batch(plain_tokens):
    mid = plain_tokens[len(plain_tokens) // 2]
    return [mid[NEW // 2]]


def check_pairs_follow_target(target, prompt: list[int], pairs: np.ndarray, sampling: Sampling) -> None:
    """Chi-square: the (first, second) generated tokens [n, 2] after `prompt` follow the target's joint warped
    distribution (rare cells pooled); no token outside the warped support."""
    warped = lambda logits: np.exp(np.asarray(warp(jnp.asarray(logits), sampling)))
    p_first = warped(np.asarray(target.logits([prompt]))[0, -1])
    firsts = np.unique(pairs[:, 0])
    p_second = warped(np.asarray(target.logits([prompt + [int(f)] for f in firsts]))[:, -1])
    expected = p_first[firsts, None] * p_second  # joint over (first, second), renormalised below
    observed = np.zeros_like(expected)
    np.add.at(observed, (np.searchsorted(firsts, pairs[:, 0]), pairs[:, 1]), 1)
    assert observed[expected == 0].sum() == 0, "a token outside the warped support was emitted"
    expected *= observed.sum() / expected.sum()
    keep = expected >= 5  # pool the rare cells so the chi-square approximation holds
    obs, exp = np.append(observed[keep], observed[~keep].sum()), np.append(expected[keep], expected[~keep].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]  # the pooled cell is empty when top-p removed every rare token
    assert keep.sum() >= 10, "too few cells for a meaningful test"
    pvalue = stats.chisquare(obs, exp).pvalue
    assert pvalue > 1e-3, pvalue


def chisquare_pvalue(tokens_N, probs) -> float:
    """p-value of "tokens_N are iid draws from probs" (flat cells); 0 if a zero-probability cell was drawn."""
    probs = np.asarray(probs, np.float64).ravel()
    probs /= probs.sum()
    counts = np.bincount(np.asarray(tokens_N), minlength=probs.size)
    if counts[probs == 0].any():
        return 0.0
    expected = len(tokens_N) * probs[probs > 0]
    assert expected.min() >= 5, f"chi-square needs >= 5 expected draws per cell, got {expected.min():.1f}"
    return float(stats.chisquare(counts[probs > 0], expected).pvalue)
