"""Test drafters for the loop: a randomly initialised EAGLE-3 drafter and an oracle that knows the target's greedy
continuation (a test double with the Drafter interface)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np

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

    def apply(self, params, tokens_BT, hidden, pos_BT, cache, *, first_step):
        return self._logits(pos_BT), jnp.zeros((*tokens_BT.shape, 8), jnp.float32), cache

    def apply_tree(self, params, tokens_BK, hidden_BKD, pos_BK, cache, scratch, write_at, mask_BKM, prefix_len_B):
        return self._logits(pos_BK), jnp.zeros((*tokens_BK.shape, 8), jnp.float32), scratch
