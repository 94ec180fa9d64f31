"""Coupled sampling: seeded text that does not depend on what was drafted.

A row's token at sequence index i is argmax(log p_i + g_i), where p_i is the target's warped distribution there and
g_i [V] is Gumbel noise drawn from the row's own key and i alone (the Gumbel-max trick: an exact draw from p_i). The
drafter proposes its token for index i as argmax(log q + g_i) with the same noise (on a reduced draft vocabulary, the
noise of the target ids its tokens map to), and a drafted token is accepted iff it equals the target's token there.
Every emitted token is then the target's own draw at its index, so the text is token for token what plain sampling
with that key gives, whatever the draft shape, batch, segment boundaries, preemption or process layout: lossless by
construction, and testable exactly, as greedy is. The price is acceptance: a coupled draft matches at least
(1 - TV) / (1 + TV) of the time against rejection sampling's 1 - TV (Daliri et al., "Coupling without communication
and drafter-invariant speculative decoding", 2024); docs/serving.md has what it measured on the bundled pair.

Greedy rows are unaffected (a point mass plus any noise is its argmax). The noise is keyed by (the row's key,
`COUPLED`, index), a fold of its own: it never shares a draw with rejection sampling's (spec_loop's `_draws`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.decoding.sampling_params import VERIFY_MODES
from sharding.collectives import first_argmax

# The purpose folded into a row's key for its coupled noise (spec_loop's draws fold 0, 1 and 2).
COUPLED = 3


class Coupling(NamedTuple):
    """Which rows sample coupled, and the keys their noise comes from (traced)."""

    key_B: jax.Array  # the rows' own keys [B] (constant through a row's life: `spec_loop._draws` carries them)
    rows_B: jax.Array | None  # bool [B]: the coupled rows; None: every row


def check_mode(name: str, mode: Any) -> str:
    """`mode` when it is one of VERIFY_MODES; else a ValueError naming `name`."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"{name}: expected one of {', '.join(VERIFY_MODES)}, got {mode!r}")
    return mode


def noise(key_B: jax.Array, at_BT: jax.Array, vocab: int) -> jax.Array:
    """Gumbel noise [B, T, vocab] (float32): row b's at index at_BT[b, t], from key_B[b] and that index only."""

    def one(key, at):
        return jax.random.gumbel(jax.random.fold_in(jax.random.fold_in(key, COUPLED), at), (vocab,), jnp.float32)

    return jax.vmap(jax.vmap(one, (None, 0)))(key_B, at_BT)


def target_tokens(key_B: jax.Array, logp_BTV: jax.Array, at_BT: jax.Array) -> jax.Array:
    """The target's token [B, T] (int32) at each index at_BT from its warped log-probabilities: argmax(log p + g)."""
    g_BTV = noise(key_B, at_BT, logp_BTV.shape[-1])
    return first_argmax(logp_BTV + g_BTV)


def draft_tokens(key_B: jax.Array, logq_BU: jax.Array, at_B: jax.Array, vocab: int, where_U=None) -> jax.Array:
    """The drafter's proposal [B] (its own vocabulary's ids) for index at_B: argmax(log q + g), g the target's noise
    at that index over the `vocab` target ids, read at `where_U` (the target id of each draft id; None: the same)."""
    g_BV = noise(key_B, at_B[:, None], vocab)[:, 0]
    g_BU = g_BV if where_U is None else g_BV[:, where_U]
    return first_argmax(logq_BU + g_BU)


def select(coupling: Coupling, coupled: Callable[[], Any], other: Callable[[], Any]) -> Any:
    """What `coupled()` gives in the coupled rows and `other()` in the rest (pytrees with the rows first). With some
    rows coupled and some not both run, `coupled` only when some row is (a `lax.cond`); every row coupled: only it."""
    rows_B = coupling.rows_B
    if rows_B is None:
        return coupled()
    rest = other()

    def mix():
        pick = lambda a, b: jnp.where(rows_B.reshape(rows_B.shape + (1,) * (a.ndim - 1)), a, b)
        return jax.tree.map(pick, coupled(), rest)

    return jax.lax.cond(jnp.any(rows_B), mix, lambda: rest)
