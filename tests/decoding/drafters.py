"""Test drafters for the loop: a randomly initialised EAGLE-3 drafter and an oracle that knows the target's greedy
continuation (a test double with the Drafter interface)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.eagle3 import draft_config_for
from jaxspec.runtime import Drafter


def random_drafter(target, seed: int = 1) -> Drafter:
    return Drafter.random(draft_config_for(target.config), target, dtype=target.dtype, seed=seed)


class OracleDrafter:
    """Proposes ref[b, p + 2] at drafter position p: the target's own greedy token when its drafts so far were right.

    `ref_BS`: each row's prompt followed by the target's greedy continuation, at absolute positions."""

    def __init__(self, target, ref_BS: np.ndarray):
        self.target, self.ref = target, jnp.asarray(ref_BS, jnp.int32)
        self.capture_layers = (0,)
        self.config = types.SimpleNamespace(hidden_size=8)
        self.dtype, self.d2t, self.params = jnp.float32, None, {}

    def init_cache(self, batch: int, max_len: int):
        return jnp.zeros((batch,), jnp.int32)

    def to_target_ids(self, ids):
        return ids

    def apply(self, params, tokens_BT, hidden, pos_BT, cache, *, first_step):
        rows = tokens_BT.shape[0]  # the padded batch may exceed the table's rows
        ref = jnp.pad(self.ref, ((0, max(0, rows - self.ref.shape[0])), (0, 0)))[:rows]
        nxt_BT = jnp.take_along_axis(ref, jnp.clip(pos_BT + 2, 0, ref.shape[1] - 1), axis=1)
        logits = 20.0 * jax.nn.one_hot(nxt_BT, self.target.vocab_size, dtype=jnp.float32)
        return logits, jnp.zeros((*tokens_BT.shape, 8), jnp.float32), cache
