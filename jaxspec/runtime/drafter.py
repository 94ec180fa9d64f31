"""The loaded EAGLE-3 `Drafter`: its parameters on the target's mesh, and compiled entry points around `Eagle3Model`.

`Drafter.apply` is the shard_map'd step (use it inside your own jit); `logits` and `forward` are jitted conveniences.
Reading and writing drafter checkpoints (SGLang/SpecForge, speculators/vLLM, MLA layouts) is `jaxspec.io`'s job.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.models.cache import Paged, paged_specs
from jaxspec.models.eagle3 import Eagle3Config, Eagle3Model, KVCache, Split, concat_captured
from jaxspec.runtime.target import Target
from sharding.mesh import DATA
from sharding.multihost import put_global, zeros
from sharding.rules import ShardingRules


@dataclasses.dataclass(frozen=True, eq=False)
class Drafter:
    """An EAGLE-3 drafter on its target's mesh. Build with `jaxspec.io.load_drafter`, `Drafter.random` or
    `Drafter.from_host`."""

    config: Eagle3Config
    target: Target = dataclasses.field(repr=False)
    graphdef: Any = dataclasses.field(repr=False)
    params: Any = dataclasses.field(repr=False)  # nnx.State
    # [U] int32 offsets, on the host: a constant in any jit or shard_map context. None = draft ids are target ids.
    d2t: np.ndarray | None = dataclasses.field(repr=False)
    shared: tuple[str, ...] = ("embed",)  # params that ARE the target's arrays (same buffers; never saved)

    @property
    def mesh(self) -> Mesh:
        return self.target.mesh

    @property
    def rules(self) -> ShardingRules:
        return self.target.rules

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target layers whose OUTPUT residual streams the drafter reads (internal convention), ascending."""
        return self.config.capture_layers

    @property
    def dtype(self) -> jnp.dtype:
        """Compute dtype of the drafter's own weights."""
        return self.params["fc"].get_value().dtype

    @property
    def split(self) -> Split:
        """Which drafter dimensions are split over the mesh's model axis (those that divide it)."""
        return Split.plan(self.config, self.mesh.shape[self.rules.model_axis], self.rules)

    @property
    def param_rules(self) -> ShardingRules:
        """The sharding rules of the drafter's own parameters (heads replicated unless split)."""
        return self.split.rules_for(self.rules)

    def cache_specs(self) -> tuple[PartitionSpec, ...]:
        """PartitionSpecs of the cache arrays. Llama (k, v) [B, S, O, Z]: batch over data, KV heads over model if
        split. MLA (latent [B, S, C+R],): batch over data, the latent shared by all heads."""
        if self.config.mla is not None:
            return (PartitionSpec(self.rules.batch, None, None),)
        return (PartitionSpec(self.rules.batch, None, self.rules.heads if self.split.heads else None, None),) * 2

    def specs_of(self, cache) -> tuple[PartitionSpec, ...] | Paged | None:
        """The PartitionSpecs a step places `cache` in: a dense cache's (`cache_specs`), or a `Paged` pool's (its
        blocks placed as a dense cache's rows) and its tables' (rows as the batch). A pool is one for all rows: it
        needs the data axis to be 1."""
        if cache is None:
            return None
        if not isinstance(cache, Paged):
            return self.cache_specs()
        return paged_specs(self.mesh, self.cache_specs(), self.rules.batch)

    def apply(
        self,
        params,
        tokens_BT: jax.Array,
        hidden: jax.Array,
        pos_BT: jax.Array,
        cache: KVCache | None = None,
        *,
        first_step: bool,
        at_B: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, KVCache | None]:
        """Sharded drafter step (traceable; call inside jit).

        `hidden` is the captured aux [B,T,X*Dt] (ascending layers, see `concat_captured`) when `first_step`, else
        the previous step's h2 [B,T,D]. Returns (fp32 draft logits [B,T,U], h2 [B,T,D], cache). Cache entries are
        written at `pos_BT` (contiguous per sequence) and attention is causal by position. With `at_B` [B] (int32,
        an index into T per row) the logits and h2 are those of position `at_B` only, [B,1,...]: every position
        still writes its cache entry, and only that one runs the MLP and the head (`Eagle3Model.__call__`).
        """
        cfg = self.config
        width = len(cfg.capture_layers) * cfg.target_hidden_size if first_step else cfg.hidden_size
        if hidden.shape != (*tokens_BT.shape, width):
            raise ValueError(f"hidden: expected shape {(*tokens_BT.shape, width)}, got {hidden.shape}")
        batch, kv_block = self.rules.batch, self.target.kv_block
        cache_spec = self.specs_of(cache)

        if at_B is not None and at_B.shape != tokens_BT.shape[:1]:
            raise ValueError(f"at_B: expected shape {tokens_BT.shape[:1]}, got {at_B.shape}")

        def local(params, tokens, hidden, pos, cache, at):
            model = nnx.merge(self.graphdef, params)  # a pool (`Paged`) is written and read in place, row by row
            return model(tokens, hidden, pos, cache, first_step=first_step, kv_block=kv_block, at_B=at)

        args = (tokens_BT, hidden, pos_BT, cache, at_B)
        specs = (PartitionSpec(batch, None), PartitionSpec(batch, None, None), PartitionSpec(batch, None), cache_spec)
        return self._sharded_step(local, params, args, (*specs, PartitionSpec(batch)), cache_spec)

    def apply_tree(
        self,
        params,
        tokens_BK: jax.Array,
        hidden_BKD: jax.Array,
        pos_BK: jax.Array,
        cache: KVCache,
        scratch: KVCache,
        write_at: int,
        mask_BKM: jax.Array,
        prefix_len_B: jax.Array,
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        """Sharded draft step over K tree nodes per row (traceable; see `Eagle3Model.tree_step`): the cache is only
        read, the nodes' own entries go to `scratch` (from `init_scratch`). Returns (fp32 logits [B,K,U], h2
        [B,K,D], scratch)."""
        if hidden_BKD.shape != (*tokens_BK.shape, self.config.hidden_size):
            raise ValueError(
                f"hidden_BKD: expected {(*tokens_BK.shape, self.config.hidden_size)}, got {hidden_BKD.shape}"
            )
        batch, cache_spec, kv_block = self.rules.batch, self.cache_specs(), self.target.kv_block

        def local(params, tokens, hidden, pos, cache, scratch, mask, prefix):
            model = nnx.merge(self.graphdef, params)  # the cache (a pool read in place, or dense) is only read
            return model.tree_step(tokens, hidden, pos, cache, scratch, write_at, mask, prefix, kv_block=kv_block)

        args = (tokens_BK, hidden_BKD, pos_BK, cache, scratch, mask_BKM, prefix_len_B)
        specs = (
            PartitionSpec(batch, None),
            PartitionSpec(batch, None, None),
            PartitionSpec(batch, None),
            self.specs_of(cache),
            cache_spec,
            PartitionSpec(batch, None, None),
        )
        return self._sharded_step(local, params, args, (*specs, PartitionSpec(batch)), cache_spec)

    def _sharded_step(self, local, params, args: tuple, specs: tuple, cache_spec) -> tuple[jax.Array, jax.Array, Any]:
        """`local(params, *args)` -> (logits, h2, cache) per device under shard_map, each argument resharded to its
        spec first (a cache tuple to its tuple of specs; None stays None)."""

        def put(x, spec):
            if x is None:
                return None
            if isinstance(x, Paged):
                return Paged(put(x.pool, spec.pool), put(x.tables, spec.tables))
            if isinstance(x, tuple):
                return tuple(put(c, sc) for c, sc in zip(x, spec, strict=True))
            return jax.sharding.reshard(x, NamedSharding(self.mesh, spec))

        batch = self.rules.batch
        fn = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(Target.param_specs(params, self.param_rules), *specs),
            out_specs=(
                PartitionSpec(batch, None, self.rules.vocab if self.split.vocab else None),
                PartitionSpec(batch, None, None),
                cache_spec,
            ),
        )
        return fn(params, *(put(x, spec) for x, spec in zip(args, specs, strict=True)))

    @classmethod
    def random(
        cls, cfg: Eagle3Config, target: Target, *, d2t: np.ndarray | None = None, dtype=jnp.bfloat16, seed: int = 0
    ) -> Drafter:
        """A randomly initialised drafter for `target` (to train, or as a bad drafter in tests), on its mesh.

        It uses the target's embedding; `d2t` ([draft_vocab] offsets) is required when the draft vocabulary is smaller
        than the target's."""
        if (d2t is None) != cfg.full_vocab:
            raise ValueError("d2t: required exactly when draft_vocab_size < vocab_size")
        split = Split.plan(cfg, target.mesh.shape[target.rules.model_axis], target.rules)
        graphdef, abstract = nnx.split(
            nnx.eval_shape(lambda: Eagle3Model(cfg, dtype=dtype, split=split, rngs=nnx.Rngs(0)))
        )
        specs = Target.param_specs(abstract, split.rules_for(target.rules))
        shardings = jax.tree.map(lambda spec: NamedSharding(target.mesh, spec), specs)
        make = lambda: nnx.state(Eagle3Model(cfg, dtype=dtype, split=split, rngs=nnx.Rngs(seed)))
        params = jax.jit(make, out_shardings=shardings)()
        params["embed"] = params["embed"].replace(target.params["embed"].get_value())
        d2t = None if d2t is None else np.asarray(d2t, np.int32)
        return cls(cfg, target, graphdef, params, d2t, ("embed",))

    @classmethod
    def from_host(
        cls,
        cfg: Eagle3Config,
        target: Target,
        host: Mapping[str, np.ndarray],
        d2t: np.ndarray | None,
        *,
        dtype=jnp.bfloat16,
    ) -> Drafter:
        """Place host weights ({dotted param name: array in our layout}) on the target's mesh.

        `embed` and `lm_head`, when absent from `host`, are the target's arrays (same buffers, never copied)."""
        mesh, shared = target.mesh, tuple(k for k in ("embed", "lm_head") if k not in host)
        split = Split.plan(cfg, mesh.shape[target.rules.model_axis], target.rules)
        graphdef, abstract = nnx.split(
            nnx.eval_shape(lambda: Eagle3Model(cfg, dtype=dtype, split=split, rngs=nnx.Rngs(0)))
        )
        rules = split.rules_for(target.rules)

        def place(path, var):
            if path[0] in shared:  # the target's embed [V,D] / lm_head [D,V]: same layout and sharding, no copy
                return path, var.replace(target.params[path[0]].get_value())
            expect = var.get_value()
            # From host memory straight to the shards (a device array would be resharded by a compiled program).
            arr = np.asarray(host[".".join(map(str, path))].reshape(expect.shape), np.dtype(expect.dtype))
            spec = rules.spec(var.get_metadata()["logical_axes"])
            return path, var.replace(put_global(arr, NamedSharding(mesh, spec)))  # this process's shards

        params = nnx.from_flat_state([place(p, v) for p, v in nnx.to_flat_state(abstract)])
        d2t = None if d2t is None else d2t.astype(np.int32)  # offsets < vocab size
        return cls(cfg, target, graphdef, params, d2t, shared)

    # ------------------------------------------------------------------ user entry points
    def logits(self, aux_hidden, token_ids) -> jax.Array:
        """First-step draft logits [B,T,U] (fp32) for a whole sequence, causal, positions 0..T-1, no cache.

        `aux_hidden` [B,T,X*Dt] are the target states of `capture_layers` concatenated low -> high.
        """
        tokens = self.device_tokens(token_ids)
        return _jit_logits(self, self.params, jnp.asarray(aux_hidden), tokens)

    def aux_hidden(self, token_ids) -> jax.Array:
        """The drafter's first-step input for these tokens: the target's `capture_layers` outputs, [B,T,X*D]."""
        return concat_captured(jnp.stack(self.target.hidden_states(token_ids, self.capture_layers)))

    def forward(self, token_ids, hidden, positions, cache: KVCache, *, first_step: bool):
        """One cached step (see `apply`): returns (logits [B,T,U], h2 [B,T,D], new cache). The cache is donated."""
        tokens = self.device_tokens(token_ids)
        pos = jnp.asarray(positions, jnp.int32)
        if pos.shape != tokens.shape:
            raise ValueError(f"positions: expected shape {tokens.shape}, got {pos.shape}")
        return _jit_forward(self, self.params, tokens, jnp.asarray(hidden), pos, cache, first_step)

    def cache_shape(self, batch: int, slots: int) -> tuple[int, ...]:
        """The shape of each cache array (the cache's one declaration, with `cache_specs`): Llama (k, v), each
        [B, S, kv_heads, head_dim]; MLA (latent,) [B, S, kv_lora_rank + qk_rope_head_dim]."""
        cfg = self.config
        if cfg.mla is not None:
            return (batch, slots, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
        return (batch, slots, cfg.num_key_value_heads, cfg.head_dim)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """Zeroed cache in the drafter dtype (`cache_shape`), made in its shards."""
        shape = self.cache_shape(batch, max_len)
        return tuple(zeros(shape, self.dtype, NamedSharding(self.mesh, s)) for s in self.cache_specs())

    def init_scratch(self, batch: int, entries: int) -> KVCache:
        """Zeroed scratch entries for `apply_tree`: a cache of `entries` slots (traceable; sharded as the cache)."""
        shape = self.cache_shape(batch, entries)
        return tuple(jnp.zeros(shape, self.dtype, out_sharding=NamedSharding(self.mesh, s)) for s in self.cache_specs())

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        """Draft-vocabulary ids -> target ids (`id + d2t[id]`); traceable, also inside shard_map."""
        if self.d2t is None:
            return draft_ids
        draft_ids = jnp.asarray(draft_ids)
        # Explicit-axes meshes need the gather's output sharding stated: it follows the ids (d2t is a constant).
        offsets = jnp.asarray(self.d2t).at[draft_ids].get(out_sharding=jax.typeof(draft_ids).sharding)
        return draft_ids + offsets.astype(draft_ids.dtype)

    def device_tokens(self, token_ids) -> jax.Array:
        arr = np.asarray(token_ids)
        arr = arr[None] if arr.ndim == 1 else arr
        if arr.ndim != 2 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"token ids: expected a non-empty integer array [B, T], got shape {arr.shape}")
        if arr.min() < 0 or arr.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}); got [{arr.min()}, {arr.max()}]")
        if arr.shape[0] % self.mesh.shape[DATA]:
            raise ValueError(f"batch {arr.shape[0]} is not divisible by the mesh's data axis ({self.mesh.shape[DATA]})")
        return jnp.asarray(arr, jnp.int32)

    def __hash__(self) -> int:  # jit static argument: identity
        return id(self)


# The Drafter is a static (hashed by identity) argument; its parameters are passed as arguments, never closed over.
@functools.partial(jax.jit, static_argnums=0)
def _jit_logits(drafter: Drafter, params, aux, tokens):
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return drafter.apply(params, tokens, aux, pos, None, first_step=True)[0]


@functools.partial(jax.jit, static_argnums=(0, 6), donate_argnums=5)
def _jit_forward(drafter: Drafter, params, tokens, hidden, pos, cache, first_step):
    return drafter.apply(params, tokens, hidden, pos, cache, first_step=first_step)
