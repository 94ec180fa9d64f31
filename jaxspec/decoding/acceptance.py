"""Accept rules for a chain of J draft tokens per sequence: greedy prefix match and lossless speculative sampling.

J is the draft depth k and T = J + 1 the verified positions (the target scores the root and every draft token). Both
rules return (num_accepted_B, next_token_B): a sequence advances by its first num_accepted draft tokens plus
next_token, which is the target's correction at the first rejected position, or the bonus token from position J when
all J are accepted. J = 0 is plain decoding: next_token comes from position 0. Pure and jittable; no control flow on
traced values, every row of the batch decides independently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def greedy_accept(draft_BJ: jax.Array, target_logits_BTV: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Accept the longest prefix of draft tokens equal to the target's argmax; next token is the argmax after it."""
    _check_shapes(draft_BJ, target_logits_BTV)
    return greedy_accept_ids(draft_BJ, jnp.argmax(target_logits_BTV, axis=-1))


def greedy_accept_ids(draft_BJ: jax.Array, target_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`greedy_accept` on the target's argmax ids [B, J+1] (e.g. from a vocab-split argmax that never gathered V)."""
    if target_BT.shape != (draft_BJ.shape[0], draft_BJ.shape[1] + 1):
        raise ValueError(
            f"target ids: expected [B, J+1] = {(draft_BJ.shape[0], draft_BJ.shape[1] + 1)}, got {target_BT.shape}"
        )
    num_accepted_B = _prefix_length(draft_BJ == target_BT[:, :-1])
    next_token_B = jnp.take_along_axis(target_BT, num_accepted_B[:, None], axis=1)[:, 0]
    return num_accepted_B, next_token_B.astype(jnp.int32)


def speculative_accept(
    key: jax.Array, draft_BJ: jax.Array, q_probs_BJV: jax.Array, p_probs_BTV: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Lossless speculative sampling over a chain (Leviathan et al. 2023, Chen et al. 2023).

    q_probs_BJV is the distribution each draft token was drawn from, p_probs_BTV the target's at the T = J + 1 verified
    positions, both warped by the same `Sampling`. Draft token j is accepted with probability min(1, p_j(x_j) /
    q_j(x_j)); the first rejection draws from normalize(max(0, p_j - q_j)); if all J are accepted the bonus is drawn
    from p_J. The emitted tokens are then distributed exactly as p, whatever q is.

    A greedy drafter passes one-hot q: x is then accepted with probability p(x), and a rejection draws from p with x
    removed and renormalised, because max(0, p - onehot(x)) is exactly p with x zeroed (no division involved).
    """
    _check_shapes(draft_BJ, p_probs_BTV)
    if q_probs_BJV.shape != (*draft_BJ.shape, p_probs_BTV.shape[-1]):
        raise ValueError(f"q_probs_BJV: expected {(*draft_BJ.shape, p_probs_BTV.shape[-1])}, got {q_probs_BJV.shape}")
    accept_key, resample_key = jax.random.split(key)
    p_BTV, q_BJV = p_probs_BTV.astype(jnp.float32), q_probs_BJV.astype(jnp.float32)
    batch, depth = draft_BJ.shape
    p_draft_BJ = jnp.take_along_axis(p_BTV[:, :depth], draft_BJ[..., None], axis=-1)[..., 0]
    q_draft_BJ = jnp.take_along_axis(q_BJV, draft_BJ[..., None], axis=-1)[..., 0]
    # u < p/q without the division (q(x) = 0 cannot make NaN); u < 1, so the min(1, .) is implicit.
    u_BJ = jax.random.uniform(accept_key, (batch, depth))
    num_accepted_B = _prefix_length(u_BJ * q_draft_BJ < p_draft_BJ)
    # The row where the next token is drawn; q reads as zeros at the bonus position J, so the residual there is p_J.
    row = num_accepted_B[:, None, None]
    p_BV = jnp.take_along_axis(p_BTV, row, axis=1)[:, 0]
    q_BV = jnp.take_along_axis(q_BJV, row, axis=1, mode="fill", fill_value=0)[:, 0]
    next_token_B = jax.random.categorical(resample_key, jnp.log(residual_distribution(p_BV, q_BV)), axis=-1)
    return num_accepted_B, next_token_B.astype(jnp.int32)


def residual_distribution(p_BV: jax.Array, q_BV: jax.Array) -> jax.Array:
    """max(0, p - q), unnormalised (the sampler takes unnormalised logits); p where that is all zero.

    It is all zero only when p == q, where a rejection has probability 0 anyway: the fallback just keeps a row of
    -inf logits (and a division by zero) out of the sampler.
    """
    residual_BV = jnp.maximum(p_BV - q_BV, 0.0)
    return jnp.where(residual_BV.sum(-1, keepdims=True) > 0, residual_BV, p_BV)


def _prefix_length(accept_BJ: jax.Array) -> jax.Array:
    """Number of leading True per row (int32)."""
    return jnp.cumprod(accept_BJ.astype(jnp.int32), axis=-1).sum(-1, dtype=jnp.int32)


def _check_shapes(draft_BJ: jax.Array, target_BTV: jax.Array) -> None:
    batch, depth = draft_BJ.shape
    if target_BTV.shape[:2] != (batch, depth + 1):
        raise ValueError(
            f"target logits/probs: expected [B, J+1, V] = [{batch}, {depth + 1}, V] for draft_BJ {draft_BJ.shape}, "
            f"got {target_BTV.shape}"
        )
