"""The loaded target model: parameters placed on a mesh, and compiled entry points around `KimiModel`.

`Target.apply` is the shard_map'd forward (use it inside your own jit, e.g. the speculative loop); `logits`,
`hidden_states` and `forward` are jitted conveniences for users and tests. Shapes are per call; jit caches one
program per distinct (shape, capture, impl). Reading and writing checkpoints is `jaxspec.io`'s job.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.config import KV_CACHE_DTYPES, KimiConfig
from jaxspec.models.cache import PACKED, SCALE_BYTES, Paged, paged_specs
from jaxspec.models.dcp import Stripes, compact_striped
from jaxspec.models.kimi import KimiModel
from jaxspec.models.mla import AttnImpl, kv_block_for
from jaxspec.models.moe import ExpertImpl, MoE
from jaxspec.models.quant import Fp8Array, Int4Array
from jaxspec.models.tree_attention import compact_path
from sharding.collectives import sharded_argmax, sharded_top_k
from sharding.inspect import per_device_param_bytes
from sharding.mesh import DATA, platform_of, single_device_mesh
from sharding.multihost import put_global, zeros
from sharding.rules import DEFAULT_RULES, ShardingRules, check_divisible

# Above this many query tokens a call attends in the expanded (prefill) form, at or below it in the absorbed form.
ABSORBED_MAX_TOKENS = 16

Head = Literal["logits", "argmax"] | int


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
    """A Kimi/DeepSeek-V3 target on a mesh. Build with `jaxspec.io.load_target`, `Target.random`, `Target.abstract`
    or `Target.from_host`."""

    config: KimiConfig
    mesh: Mesh
    graphdef: Any
    params: Any  # nnx.State of jax.Arrays (or ShapeDtypeStructs for an abstract target)
    rules: ShardingRules = DEFAULT_RULES
    # "auto": the latent cache in the compute dtype; "fp8": float8_e4m3fn with a per-token scale (models/mla.py)
    kv_cache_dtype: str = "auto"
    # Decode context parallelism: the latent cache striped by position over groups of `dcp` devices of the model axis
    # (models/dcp.py); 1: every device of the model axis holds every position.
    dcp: int = 1

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        check_dcp(self.dcp, self.mesh, self.rules)

    @property
    def kv_block(self) -> int:
        """Cache positions per block of attention's live-prefix loop on this target's platform (mla.kv_block_for; an
        abstract mesh's abstract device, e.g. for `jax.export`): the default of `apply`'s, and of its drafter's."""
        return kv_block_for(platform_of(self.mesh))

    # ------------------------------------------------------------------ construction
    @staticmethod
    def abstract_model(
        cfg: KimiConfig, dtype, int4_experts: bool | None, rules: ShardingRules = DEFAULT_RULES
    ) -> nnx.Module:
        """The model's structure with ShapeDtypeStruct leaves (nothing allocated)."""
        return nnx.eval_shape(functools.partial(_model, cfg, dtype, int4_experts, rules, 0))

    @classmethod
    def param_specs(cls, params: Any, rules: ShardingRules = DEFAULT_RULES) -> Any:
        """PartitionSpec per parameter, from each weight's declared logical axes."""
        return jax.tree.map(lambda v: rules.spec(v.get_metadata()["logical_axes"]), params, is_leaf=_is_var)

    @classmethod
    def _skeleton(
        cls, cfg: KimiConfig, mesh: Mesh | None, dtype, int4_experts: bool | None, rules: ShardingRules
    ) -> tuple[Mesh, Any, Any, Any]:
        """What every constructor starts from: the mesh (one device by default) checked against the config, the
        model's graphdef and abstract parameters built with `rules` (the axis the forward reduces over), and each
        parameter's NamedSharding."""
        mesh = mesh or single_device_mesh()
        check_mesh(cfg, mesh, rules)
        graphdef, abstract = nnx.split(cls.abstract_model(cfg, dtype, int4_experts, rules))
        specs = cls.param_specs(abstract, rules)
        check_fp8_shards(abstract, specs, mesh)
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
        return mesh, graphdef, abstract, shardings

    @classmethod
    def random(
        cls,
        cfg: KimiConfig,
        *,
        mesh: Mesh | None = None,
        dtype=jnp.bfloat16,
        int4_experts: bool | None = None,
        seed: int = 0,
        rules: ShardingRules = DEFAULT_RULES,
        kv_cache_dtype: str = "auto",
    ) -> Target:
        """Randomly initialised weights, created directly in their shardings."""
        mesh, graphdef, _, shardings = cls._skeleton(cfg, mesh, dtype, int4_experts, rules)
        make = lambda: nnx.state(_model(cfg, dtype, int4_experts, rules, seed))
        params = jax.jit(make, out_shardings=shardings)()
        return cls(cfg, mesh, graphdef, params, rules, kv_cache_dtype)

    @classmethod
    def abstract(
        cls,
        cfg: KimiConfig,
        *,
        mesh: Mesh | None = None,
        dtype=jnp.bfloat16,
        int4_experts: bool | None = None,
        rules: ShardingRules = DEFAULT_RULES,
        kv_cache_dtype: str = "auto",
    ) -> Target:
        """Shapes, dtypes and shardings only: for lowering/compiling the real model without allocating it."""
        mesh, graphdef, abstract, shardings = cls._skeleton(cfg, mesh, dtype, int4_experts, rules)

        def with_sharding(var, sharding):
            return var.replace(
                jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), var.get_value())
            )

        params = jax.tree.map(with_sharding, abstract, shardings, is_leaf=_is_var)
        return cls(cfg, mesh, graphdef, params, rules, kv_cache_dtype)

    @classmethod
    def from_host(
        cls,
        cfg: KimiConfig,
        host: Mapping[tuple, Any],
        *,
        mesh: Mesh | None = None,
        dtype=jnp.bfloat16,
        rules: ShardingRules = DEFAULT_RULES,
        kv_cache_dtype: str = "auto",
    ) -> Target:
        """Place host weights ({param path: numpy array, Int4Array or Fp8Array}, every parameter of the model) on
        `mesh`.

        Each array goes straight from host memory to its shards, cast to the parameter's dtype (INT4 scales to the
        scale dtype; FP8 values keep their bytes); routed experts are INT4 exactly when the config has a quant scheme,
        and the linear weights FP8 (in the model's blocks) when it has an fp8 one."""
        mesh, graphdef, abstract, shardings = cls._skeleton(cfg, mesh, dtype, cfg.quant is not None, rules)
        shardings = dict(nnx.to_flat_state(shardings))

        def place(path, var):
            expect, value = var.get_value(), host[path]
            # Host arrays go straight to their shards (a device array would be resharded by a compiled program).
            if isinstance(expect, Int4Array):
                scale = np.asarray(value.scale).astype(expect.scale.dtype)
                arr = Int4Array(np.asarray(value.packed, np.uint8), scale, expect.group_size)
            elif isinstance(expect, Fp8Array):
                if not isinstance(value, Fp8Array) or value.blocks != expect.blocks:
                    got = value.blocks if isinstance(value, Fp8Array) else f"an unquantised {np.asarray(value).dtype}"
                    raise ValueError(f"{'.'.join(path)}: expected FP8 in blocks {expect.blocks}, got {got}")
                values = np.asarray(value.values).view(expect.values.dtype)  # the stored bytes, never a cast
                arr = Fp8Array(values, np.asarray(value.scale, expect.scale.dtype), expect.blocks)
            else:
                arr = np.asarray(value).astype(expect.dtype)
            return path, var.replace(put_global(arr, shardings[path]))  # only this process's shards

        params = nnx.from_flat_state([place(p, v) for p, v in nnx.to_flat_state(abstract)])
        return cls(cfg, mesh, graphdef, params, rules, kv_cache_dtype)

    def on_mesh(self, mesh: Mesh) -> Target:
        """The same weights placed on another mesh (e.g. 1 device -> 1x8)."""
        check_mesh(self.config, mesh, self.rules)
        specs = self.param_specs(self.params, self.rules)
        params = jax.device_put(self.params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        return dataclasses.replace(self, mesh=mesh, params=params)

    def with_expert_impl(self, impl: ExpertImpl) -> Target:
        """The same weights, with every MoE layer's routed experts on path `impl` ("auto", "xla" or "pallas"; static,
        in the graphdef)."""
        if impl not in get_args(ExpertImpl):
            raise ValueError(f"with_expert_impl: impl must be one of {get_args(ExpertImpl)}, got {impl!r}")
        model = nnx.merge(self.graphdef, self.params)
        for _, module in nnx.iter_modules(model):
            if isinstance(module, MoE):
                module.impl = impl
        return dataclasses.replace(self, graphdef=nnx.graphdef(model))

    # ------------------------------------------------------------------ the sharded forward
    @property
    def dtype(self) -> jnp.dtype:
        """Compute dtype of the non-expert weights (and of the KV cache)."""
        return self.params["embed"].get_value().dtype

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def with_kv_cache_dtype(self, kv_cache_dtype: str) -> Target:
        """The same weights with another KV cache format ("auto" or "fp8")."""
        return dataclasses.replace(self, kv_cache_dtype=kv_cache_dtype)

    def with_dcp(self, dcp: int) -> Target:
        """The same weights with the latent cache striped over groups of `dcp` devices of the model axis (1: not
        striped); kept on this target, so a second call returns the same object (and its compiled programs)."""
        if dcp == self.dcp:
            return self
        variants = vars(self).setdefault("dcp_variants", {})
        if dcp not in variants:
            variants[dcp] = dataclasses.replace(self, dcp=dcp)
        return variants[dcp]

    @property
    def stripes(self) -> Stripes | None:
        """The DCP layout the forward runs with (None: the cache is not striped)."""
        if self.dcp == 1:
            return None
        return Stripes(self.dcp, self.rules.model_axis, self.mesh.shape[self.rules.model_axis])

    def cache_positions(self, cache) -> int:
        """Positions each row of a dense cache made by `init_cache` holds (its global array holds the model axis'
        stripes side by side: model / dcp copies of each position)."""
        return cache.shape[2] * self.dcp // self.mesh.shape[self.rules.model_axis] if self.dcp > 1 else cache.shape[2]

    def cache_shape_dtype(self, batch: int, max_len: int) -> tuple[tuple[int, ...], jnp.dtype]:
        """(shape, dtype) of the latent cache: [L, B, S, C+R] in the compute dtype, or with fp8 [L, B, S, C+R+4]
        uint8 (e4m3 values, then each token's float32 scale; models/mla.py)."""
        cfg = self.config
        slots = max_len
        if self.dcp > 1:  # each device of the model axis holds max_len / dcp slots: its stripe
            if max_len % self.dcp:
                raise ValueError(
                    f"dcp: a cache of {max_len} positions (or a pool block of that many) does not split into "
                    f"{self.dcp} stripes; expected a multiple of {self.dcp}"
                )
            slots = max_len // self.dcp * self.mesh.shape[self.rules.model_axis]
        if self.kv_cache_dtype == "fp8":
            return (cfg.num_hidden_layers, batch, slots, cfg.latent_dim + SCALE_BYTES), jnp.dtype(PACKED)
        return (cfg.num_hidden_layers, batch, slots, cfg.latent_dim), self.dtype

    def abstract_cache(self, batch: int, max_len: int) -> jax.ShapeDtypeStruct:
        shape, dtype = self.cache_shape_dtype(batch, max_len)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, self.cache_spec()))

    def abstract_pool(self, batch: int, max_len: int, block: int) -> Paged:
        """The serving layout of `batch` rows of `max_len` positions, abstract: a pool of a block of `block` positions
        for each of every row's (and the null block), and the rows' tables. On TPU the pool's layout is pinned
        row-major, the paged kernel's: XLA's default for a 576-wide pool puts the blocks axis minor, and every call
        would relayout the whole pool (docs/performance.md)."""
        if block < 1 or max_len % block:
            raise ValueError(f"pool block: expected a divisor of the cache length {max_len}, got {block}")
        specs = paged_specs(self.mesh, self.cache_spec(), self.rules.batch)
        shape, dtype = self.cache_shape_dtype(batch * max_len // block + 1, block)
        sharding = NamedSharding(self.mesh, specs.pool)
        if platform_of(self.mesh) == "tpu":
            sharding = Format(Layout(major_to_minor=tuple(range(len(shape)))), sharding)
        rows = NamedSharding(self.mesh, specs.tables)
        tables = jax.ShapeDtypeStruct((batch, max_len // block), jnp.int32, sharding=rows)
        return Paged(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding), tables)

    def cache_bytes_per_device(self, batch: int, max_len: int) -> int:
        """Bytes one device holds of a cache for `batch` sequences of `max_len` positions (batch split over data)."""
        return per_device_param_bytes(self.abstract_cache(batch, max_len))

    def cache_spec(self) -> PartitionSpec:
        """PartitionSpec of the latent cache [L, B, S, C+R]: batch over data, replicated over model; with dcp > 1 the
        positions split over model (each device holds its stripe's slots)."""
        return PartitionSpec(None, self.rules.batch, self.rules.model_axis if self.dcp > 1 else None, None)

    def specs_of(self, cache) -> PartitionSpec | Paged | None:
        """The PartitionSpecs a forward places `cache` in: a dense cache's (`cache_spec`), or a `Paged` pool's (as a
        dense cache's: `init_cache(blocks, block)` makes it) and its tables' (rows as the batch). A pool is one for
        all rows: it needs the data axis to be 1, so every device holds every block."""
        if cache is None:
            return None
        if not isinstance(cache, Paged):
            return self.cache_spec()
        return paged_specs(self.mesh, self.cache_spec(), self.rules.batch)

    def apply(
        self,
        params,
        tokens_BT,
        pos_BT,
        cache_LBSY=None,
        *,
        capture: Sequence[int] = (),
        impl: AttnImpl | None = None,
        head: Head = "logits",
        kv_block: int | None = None,
        tree_mask_BTS: jax.Array | None = None,
    ):
        """Sharded forward (traceable; call inside jit). Returns (out, cache, captured [X,B,T,D]) where `out` is
        per `head`: "logits" -> [B,T,V] (vocab-split over the model axis), "argmax" -> greedy ids [B,T],
        an int k -> top-k (values [B,T,k], ids [B,T,k]). argmax/top-k never gather the vocabulary.
        With a cache, attention reads only the live prefix, in blocks of `kv_block` positions (None: this target's
        `kv_block`; see mla.py).
        `tree_mask_BTS`: verify a draft tree [B,T,T] (see `KimiModel.__call__`; absorbed attention)."""
        if tree_mask_BTS is not None and impl == "expanded":
            raise ValueError("tree_mask_BTS: tree verification runs absorbed attention, got impl='expanded'")
        impl = impl or ("absorbed" if tokens_BT.shape[1] <= ABSORBED_MAX_TOKENS else "expanded")
        batch, capture = self.rules.batch, tuple(int(c) for c in capture)
        cache_spec = self.specs_of(cache_LBSY)
        if head == "logits":
            head_spec = PartitionSpec(batch, None, self.rules.model_axis)
        elif head == "argmax":
            head_spec = PartitionSpec(batch, None)
        elif isinstance(head, int) and head > 0:
            head_spec = (PartitionSpec(batch, None, None), PartitionSpec(batch, None, None))
        else:
            raise ValueError(f"head must be 'logits', 'argmax' or a positive int k, got {head!r}")

        kv_block = self.kv_block if kv_block is None else kv_block
        opts = dict(capture=capture, impl=impl, kv_block=kv_block, stripes=self.stripes)

        def local(params, tokens, pos, cache, tree_mask):
            model = nnx.merge(self.graphdef, params)
            logits, cache, captured = model(tokens, pos, cache, tree_mask_BTS=tree_mask, **opts)
            if head == "argmax":
                logits = sharded_argmax(logits, self.rules.model_axis)
            elif head != "logits":
                logits = sharded_top_k(logits, head, self.rules.model_axis)
            return logits, cache, captured

        reshard = lambda x, spec: None if x is None else _reshard(x, self.mesh, spec)
        rows = PartitionSpec(batch, None)
        tokens_BT, pos_BT, cache_LBSY = reshard(tokens_BT, rows), reshard(pos_BT, rows), reshard(cache_LBSY, cache_spec)
        mask_spec = None if tree_mask_BTS is None else PartitionSpec(batch, None, None)
        tree_mask_BTS = reshard(tree_mask_BTS, mask_spec)
        fn = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(self.param_specs(params, self.rules), rows, rows, cache_spec, mask_spec),
            out_specs=(head_spec, cache_spec, PartitionSpec(None, batch, None, None)),
        )
        return fn(params, tokens_BT, pos_BT, cache_LBSY, tree_mask_BTS)

    def compact_cache(self, cache_LBSY, prefix_len_B, path, num_accepted_B):
        """After a tree verify: move each row's accepted path to consecutive cache slots (`tree.compact_path`),
        per data shard (traceable)."""
        batch, cache_spec, stripes = self.rules.batch, self.specs_of(cache_LBSY), self.stripes
        reshard = functools.partial(_reshard, mesh=self.mesh)
        if stripes is None:
            compact = lambda c, n, p, a: compact_path(c, n, p, a, batch_axis=1)  # noqa: E731
        else:
            compact = lambda c, n, p, a: compact_striped(c, n, p, a, stripes)  # noqa: E731
        fn = jax.shard_map(
            compact,
            mesh=self.mesh,
            in_specs=(cache_spec, PartitionSpec(batch), PartitionSpec(batch, None), PartitionSpec(batch)),
            out_specs=cache_spec,
        )
        return fn(
            reshard(cache_LBSY, spec=cache_spec),
            reshard(prefix_len_B, spec=PartitionSpec(batch)),
            reshard(path, spec=PartitionSpec(batch, None)),
            reshard(num_accepted_B, spec=PartitionSpec(batch)),
        )

    def compile_step(
        self,
        batch: int,
        tokens: int,
        cache_len: int,
        *,
        head: Head = "logits",
        tree: bool = False,
        pool_block: int | None = None,
    ):
        """AOT-compile one cached step (decode: tokens=1; verify: k+1; with `tree`, verify of a draft tree of
        `tokens` nodes under its ancestor mask) for abstract inputs; nothing is allocated beyond what `params` already
        holds. With `pool_block`, over serving's layout (`abstract_pool`: the cache a pool of blocks of that many
        positions, read in place; on TPU and GPU by the paged kernel). Used by `jaxspec inspect` and the full-size
        benchmark."""
        mesh = self.mesh
        batch_sharding = NamedSharding(mesh, PartitionSpec(self.rules.batch, None))
        ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32, sharding=batch_sharding)
        cache = self.abstract_cache(batch, cache_len)
        if pool_block is not None:
            cache = self.abstract_pool(batch, cache_len, pool_block)
        if not tree:
            step = jax.jit(lambda p, t, q, c: self.apply(p, t, q, c, head=head), donate_argnums=3)
            return step.lower(self.params, ids, ids, cache).compile()
        mask = jax.ShapeDtypeStruct(
            (batch, tokens, tokens),
            jnp.bool_,
            sharding=NamedSharding(mesh, PartitionSpec(self.rules.batch, None, None)),
        )
        step = jax.jit(lambda p, t, q, c, m: self.apply(p, t, q, c, head=head, tree_mask_BTS=m), donate_argnums=3)
        return step.lower(self.params, ids, ids, cache, mask).compile()

    # ------------------------------------------------------------------ user entry points
    def logits(self, token_ids) -> jax.Array:
        """Full forward, no cache: logits [B, T, V] for token ids [B, T] (or [T])."""
        tokens = self.device_tokens(token_ids)
        return _jit_logits(self, self.params, tokens)

    def hidden_states(self, token_ids, layers: Sequence[int]) -> tuple[jax.Array, ...]:
        """Residual streams at the OUTPUT of each decoder layer in `layers` (0-indexed), each [B, T, D]."""
        layers = tuple(int(x) for x in layers)
        bad = [x for x in layers if not 0 <= x < self.config.num_hidden_layers]
        if bad:
            raise ValueError(f"layers {bad} out of range [0, {self.config.num_hidden_layers})")
        captured = _jit_hidden(self, self.params, self.device_tokens(token_ids), layers)
        return tuple(captured[i] for i in range(len(layers)))

    def init_cache(self, batch: int, max_len: int) -> jax.Array:
        """Zeroed latent cache [L, B, S, kv_lora_rank + qk_rope_head_dim] in the model dtype, or in the fp8
        format with `kv_cache_dtype="fp8"` (see `cache_shape_dtype`), made in its shards (sharding/multihost.py)."""
        shape, dtype = self.cache_shape_dtype(batch, max_len)
        return zeros(shape, dtype, NamedSharding(self.mesh, self.cache_spec()))

    def forward(self, token_ids, positions, cache, *, capture: Sequence[int] = (), impl: AttnImpl | None = None):
        """One cached step: write T tokens at `positions` [B, T] (contiguous per sequence) and return
        (logits [B,T,V], new cache, captured [X,B,T,D]). The input cache is donated."""
        tokens = self.device_tokens(token_ids)
        pos = jnp.asarray(positions, jnp.int32)
        if pos.shape != tokens.shape:
            raise ValueError(f"positions: expected shape {tokens.shape}, got {pos.shape}")
        if self.cache_positions(cache) < int(jnp.max(pos)) + 1:
            raise ValueError(
                f"cache holds {self.cache_positions(cache)} positions, step writes up to {int(jnp.max(pos))}"
            )
        return _jit_forward(self, self.params, tokens, pos, cache, tuple(capture), impl)

    def device_tokens(self, token_ids) -> jax.Array:
        arr = np.asarray(token_ids)
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                f"token ids: expected a non-empty integer array [B, T], got shape {arr.shape} dtype {arr.dtype}"
            )
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, vocab_size={self.config.vocab_size}); got min {lo}, max {hi}")
        data = self.mesh.shape[DATA]
        if arr.shape[0] % data:
            raise ValueError(f"batch {arr.shape[0]} is not divisible by the mesh's data axis ({data})")
        return jnp.asarray(arr, jnp.int32)

    def __hash__(self) -> int:  # jit static argument: identity
        return id(self)


# The Target is a static (hashed by identity) argument; its parameters are passed as arguments, never closed over.
@functools.partial(jax.jit, static_argnums=0)
def _jit_logits(target: Target, params, tokens):
    return _run(target, params, tokens)[0]


@functools.partial(jax.jit, static_argnums=(0, 3))
def _jit_hidden(target: Target, params, tokens, layers):
    return _run(target, params, tokens, capture=layers)[2]


def _run(target, params, tokens, capture=()):
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return target.apply(params, tokens, pos, None, capture=capture, impl="expanded")


@functools.partial(jax.jit, static_argnums=(0, 5, 6), donate_argnums=4)
def _jit_forward(target, params, tokens, pos, cache, capture, impl):
    return target.apply(params, tokens, pos, cache, capture=capture, impl=impl)


def _model(cfg: KimiConfig, dtype, int4_experts: bool | None, rules: ShardingRules, seed: int) -> KimiModel:
    return KimiModel(cfg, dtype=dtype, int4_experts=int4_experts, rules=rules, rngs=nnx.Rngs(seed))


def check_fp8_shards(abstract: Any, specs: Any, mesh: Mesh) -> None:
    """Raise unless every shard of an FP8 weight holds whole blocks (so each device's scales are its values')."""
    flat_specs = dict(nnx.to_flat_state(specs))
    for path, var in nnx.to_flat_state(abstract):
        w = var.get_value()
        if not isinstance(w, Fp8Array):
            continue
        spec = tuple(flat_specs[path]) + (None,) * w.ndim
        for axis, b in enumerate(w.blocks, start=w.ndim - len(w.blocks)):
            names = spec[axis] if isinstance(spec[axis], tuple) else (spec[axis],)
            parts = int(np.prod([mesh.shape[n] for n in names if n is not None]))
            if b > 1 and parts > 1 and (w.shape[axis] // parts) % b:
                raise ValueError(
                    f"{'.'.join(map(str, path))}: axis {axis} of {list(w.shape)} splits into {parts} shards of "
                    f"{w.shape[axis] // parts}, not whole FP8 blocks of {b}"
                )


def check_dcp(dcp: Any, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> None:
    """Raise unless `dcp` (devices a cache's positions are striped over) is a whole number dividing the model axis."""
    axis = rules.model_axis
    if isinstance(dcp, bool) or not isinstance(dcp, int | np.integer) or dcp < 1:
        raise ValueError(f"dcp: expected a whole number >= 1, got {dcp!r}")
    if mesh.shape[axis] % dcp:
        raise ValueError(f"dcp: {dcp} does not divide the mesh's {axis!r} axis of {mesh.shape[axis]} devices")


def check_mesh(cfg: KimiConfig, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> None:
    """Raise if a dimension the rules split over a mesh axis does not divide by that axis' size."""
    check_divisible(
        mesh,
        {
            "heads": cfg.num_attention_heads,
            "experts": cfg.n_routed_experts,
            "vocab": cfg.vocab_size,
            "mlp": cfg.intermediate_size,
        },
        rules,
    )
    check_divisible(mesh, {"mlp": cfg.moe_intermediate_size * cfg.n_shared_experts}, rules)


def _reshard(x, mesh: Mesh, spec):
    """`x` (an array, or a `Paged` cache with a `Paged` of specs) placed as `spec` says on `mesh`."""
    if isinstance(x, Paged):
        return Paged(*(_reshard(a, mesh, s) for a, s in zip(x, spec, strict=True)))
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))
