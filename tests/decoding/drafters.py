"""Test drafters for the loop: a randomly initialised EAGLE-3 drafter and an oracle that knows the target's greedy
continuation (a test double with the Drafter interface)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import Eagle3Config
from jaxspec.drafter import Drafter


def random_drafter(target, seed: int = 1) -> Drafter:
    L = target.config.num_hidden_layers
    cfg = Eagle3Config.from_hf_config(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": target.config.hidden_size,
            "intermediate_size": 2 * target.config.hidden_size,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "num_hidden_layers": 1,
            "vocab_size": target.config.vocab_size,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 1024,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, L // 2, L - 1]},
        },
        target_config=target.config,
    )
    return Drafter.random(cfg, target, dtype=target.dtype, seed=seed)


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
