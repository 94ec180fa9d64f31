"""Meshes, logical-axis sharding rules, explicit collectives and their measurement.

Sharding style (one, chosen deliberately): meshes are built with `AxisType.Explicit` axes, and every model forward
runs as ONE fully-manual `jax.shard_map` over the whole mesh with stated in/out specs. Inside it the code sees
per-device shards and every collective is written out (`psum` after attention, `psum` after the MLP/MoE, `psum` for
the vocab-split embedding lookup). Nothing relies on GSPMD propagation, so the collective count per layer is what the
code says (2), and no weight is ever all-gathered. See `rules.py` for the logical-axis table.
"""
