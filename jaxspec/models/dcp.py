"""Decode context parallelism (DCP): the target's latent cache striped by position over groups of the model axis.

The 576-wide latent entry of a position is shared by every head, so with the heads split over the model axis each
device used to hold every position of every row. With `--dcp n` the model axis is cut into groups of n consecutive
devices; device r of a group (r = model index mod n) holds the positions p with p mod n = r, in its own slot p // n.
A paged pool is striped inside each block (block % n == 0): slot p // n of a row is in the same table entry as p, so
block tables, prefix hashes and preemption do not change; a dense cache [L, B, S, Y] holds S / n slots per device.

Attention over the cache (absorbed form only: the latent is what is striped), per layer:
1. one all-gather over the group of the absorbed queries and RoPE queries (the group's n x N heads);
2. each device runs mla.py's live-prefix loop over its own slots for all the group's heads, with each query position
   q mapped to the last slot it may see, (q - r) // n: the causal (and the tree's prefix) mask is per position, so it
   follows the striping, and the loop reads 1/n of each row's live cache;
3. one all-to-all over the group sends each device the partial softmax states (max, denominator, output) of its own
   heads from every stripe, packed in one array; `merge` combines them exactly (log-sum-exp).
Writes land only on the device that owns a position (`slots`). Two collectives per layer, what the math needs: the
queries must meet every stripe, and each head's partial states must meet on one device.

Runs per device inside shard_map, like mla.py.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.models.cache import Cache, Paged

# Slot of a position this device does not own: past any cache, so `write_cache` drops the write.
DROPPED = 2**30


class Stripes(NamedTuple):
    """The DCP layout inside shard_map: groups of `n` consecutive devices of the `size`-device mesh axis `axis`."""

    n: int
    axis: str
    size: int

    def groups(self) -> list[list[int]]:
        return [list(range(g, g + self.n)) for g in range(0, self.size, self.n)]

    def rank(self) -> jax.Array:
        """This device's stripe: the positions p with p mod n == rank."""
        return jax.lax.axis_index(self.axis) % self.n

    def slots(self, pos_BT: jax.Array) -> jax.Array:
        """Each position's slot in this device's cache (p // n), or `DROPPED` where another device owns it."""
        mine_BT = (pos_BT >= 0) & (pos_BT % self.n == self.rank())
        return jnp.where(mine_BT, pos_BT // self.n, DROPPED)

    def visible(self, pos_BT: jax.Array) -> jax.Array:
        """The last slot of this device a query at position p may see (floor((p - rank) / n); -1: none)."""
        return jnp.floor_divide(pos_BT - self.rank(), self.n)

    def gather(self, x: jax.Array, axis: int) -> jax.Array:
        """`x` of every device of the group, concatenated along `axis` in group order."""
        return jax.lax.all_gather(x, self.axis, axis=axis, tiled=True, axis_index_groups=self.groups())

    def merge(self, state):
        """The group's partial softmax states of all its heads, [B,G,T] / [B,G,T] / [B,T,G,C] with G = n x N, each
        over one stripe -> this device's N heads over every stripe (one all-to-all, then a log-sum-exp merge)."""
        m_BGT, l_BGT, acc_BTGC = state
        B, T, G, C = acc_BTGC.shape
        lanes = lambda x_BGT: x_BGT.transpose(0, 2, 1)[..., None]  # noqa: E731
        packed = jnp.concatenate([acc_BTGC, lanes(m_BGT), lanes(l_BGT)], axis=-1).reshape(B, T, self.n, G // self.n, -1)
        got_BTINW = jax.lax.all_to_all(packed, self.axis, 2, 2, tiled=True, axis_index_groups=self.groups())
        m_BTIN, l_BTIN, acc_BTINC = got_BTINW[..., C], got_BTINW[..., C + 1], got_BTINW[..., :C]
        m_BTN = m_BTIN.max(axis=2)
        w_BTIN = jnp.exp(m_BTIN - m_BTN[:, :, None])
        l_BTN = (l_BTIN * w_BTIN).sum(axis=2)
        acc_BTNC = (acc_BTINC * w_BTIN[..., None]).sum(axis=2)
        return m_BTN.transpose(0, 2, 1), l_BTN.transpose(0, 2, 1), acc_BTNC


def compact_striped(
    cache: Cache, prefix_len_B: jax.Array, path: jax.Array, num_accepted_B: jax.Array, stripes: Stripes
) -> Cache:
    """`tree_attention.compact_path` on a striped target cache: slot prefix + path[j] -> prefix + j, j <= accepted.
    Source and destination may be on different devices of the group: each device reads the path entries it owns,
    one all-gather over the group gives every device each entry from its owner, and each writes the ones it owns."""
    B = prefix_len_B.shape[0]
    j = jnp.arange(path.shape[1], dtype=jnp.int32)
    src_BP = prefix_len_B[:, None] + path
    dst_BP = jnp.where(j <= num_accepted_B[:, None], prefix_len_B[:, None] + j, -1)
    rows_BP = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], path.shape)

    def at(slots_BP):
        if isinstance(cache, Paged):
            return (slice(None), *cache.slots(slots_BP))
        return slice(None), rows_BP, slots_BP

    own_LBPY = (cache.pool if isinstance(cache, Paged) else cache)[at(stripes.slots(src_BP))]  # OOB reads clamp
    every_ILBPY = stripes.gather(own_LBPY[None], axis=0)
    owner_BP = src_BP % stripes.n
    moved_LBPY = jnp.take_along_axis(every_ILBPY, owner_BP[None, None, :, :, None], axis=0)[0]
    if isinstance(cache, Paged):
        return cache._replace(pool=cache.pool.at[at(stripes.slots(dst_BP))].set(moved_LBPY, mode="drop"))
    return cache.at[at(stripes.slots(dst_BP))].set(moved_LBPY, mode="drop")
