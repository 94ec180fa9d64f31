"""EAGLE-3 drafter checkpoints (SGLang/SpecForge and speculators/vLLM layouts) and the loaded `Drafter` on a mesh.

Both layouts hold the same tensors (HF [out, in] weights); they differ in the layer prefix (`midlayer.` vs
`layers.0.`), in config.json, and in the meaning of the capture-layer ids (see `jaxspec/models/eagle3.py`).
`load_drafter` reads either, converts the ids to the internal output-of-layer-k convention, checks every tensor
against the config and the target, and only then places anything on devices. `save_drafter` writes either layout.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from jaxspec.config import ConfigError
from jaxspec.hf import CheckpointError, SafetensorsDir
from jaxspec.models.eagle3 import (
    SGLANG_ARCHITECTURE,
    SPECULATORS_TYPE,
    Convention,
    Eagle3Config,
    Eagle3Model,
    KVCache,
    Split,
    concat_captured,
)
from jaxspec.target import Target
from sharding.mesh import DATA, MODEL
from sharding.rules import ShardingRules

Format = Literal["sglang", "speculators", "mla"]
LAYER_PREFIX: dict[str, str] = {"sglang": "midlayer.", "speculators": "layers.0.", "mla": "midlayer."}
# Tensors some writers add that inference never reads (speculators' frozen verifier copies, rotary buffers).
IGNORED = ("verifier_norm.weight", "verifier_lm_head.weight")


def _table(cfg: Eagle3Config) -> list[tuple[str, str, tuple[int, ...]]]:
    """(param name, HF name with `{L}` for the layer prefix, HF shape). Ours = HF.T reshaped (vectors as-is).

    An MLA drafter's attention is not in it (see `_mla_table`)."""
    rows = _llama_table(cfg)
    return rows if cfg.mla is None else [r for r in rows if not r[1].startswith("{L}self_attn.")]


def _mla_table(cfg: Eagle3Config) -> list[tuple[str, tuple[int, ...], Any, Any]]:
    """An MLA drafter's attention: (HF name with `{L}`, HF shape, HF -> {param key: ours}, ours (by key) -> HF).

    HF layout as the target's DeepseekV3 attention, with 2D-wide q_a_proj / kv_a_proj_with_mqa inputs."""
    m, D = cfg.mla, cfg.hidden_size
    N, H, R, A = m.num_attention_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    Q, C = m.q_lora_rank, m.kv_lora_rank

    def heads(w, *widths):  # [N * sum(widths), in] -> one [in, N, width] block per width
        w = w.reshape(N, sum(widths), -1)
        bounds = np.cumsum((0, *widths))
        return [w[:, lo:hi].transpose(2, 0, 1) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]

    def rows(*parts):  # the inverse: per-head blocks [in, N, h_i] -> [N * sum(h_i), in]
        w = np.concatenate(parts, axis=-1)
        return w.transpose(1, 2, 0).reshape(-1, w.shape[0])

    a = "attn."
    vec = lambda key: (lambda w: {a + key: w}, lambda get: get(a + key))  # noqa: E731
    return [
        ("{L}self_attn.q_a_proj.weight", (Q, 2 * D), lambda w: {a + "q_a": w.T}, lambda get: get(a + "q_a").T),
        ("{L}self_attn.q_a_layernorm.weight", (Q,), *vec("q_a_norm")),
        (
            "{L}self_attn.q_b_proj.weight",
            (N * (H + R), Q),
            lambda w: dict(zip((a + "q_b_nope", a + "q_b_rope"), heads(w, H, R), strict=True)),
            lambda get: rows(get(a + "q_b_nope"), get(a + "q_b_rope")),
        ),
        (
            "{L}self_attn.kv_a_proj_with_mqa.weight",
            (C + R, 2 * D),
            lambda w: {a + "kv_a_latent": w[:C].T, a + "kv_a_rope": w[C:].T},
            lambda get: np.concatenate([get(a + "kv_a_latent"), get(a + "kv_a_rope")], axis=1).T,
        ),
        ("{L}self_attn.kv_a_layernorm.weight", (C,), *vec("kv_a_norm")),
        (
            "{L}self_attn.kv_b_proj.weight",
            (N * (H + A), C),
            lambda w: dict(zip((a + "kv_b_k", a + "kv_b_v"), heads(w, H, A), strict=True)),
            lambda get: rows(get(a + "kv_b_k"), get(a + "kv_b_v")),
        ),
        (
            "{L}self_attn.o_proj.weight",
            (D, N * A),
            lambda w: {a + "o": w.reshape(D, N, A).transpose(1, 2, 0)},
            lambda get: get(a + "o").transpose(2, 0, 1).reshape(D, N * A),
        ),
    ]


def _llama_table(cfg: Eagle3Config) -> list[tuple[str, str, tuple[int, ...]]]:
    D, F, U = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size
    NZ, JZ = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    XD = len(cfg.capture_layers) * cfg.target_hidden_size
    return [
        ("fc", "fc.weight", (D, XD)),
        ("input_norm", "{L}input_layernorm.weight", (D,)),
        ("hidden_norm", "{L}hidden_norm.weight", (D,)),
        ("q", "{L}self_attn.q_proj.weight", (NZ, 2 * D)),
        ("k", "{L}self_attn.k_proj.weight", (JZ, 2 * D)),
        ("v", "{L}self_attn.v_proj.weight", (JZ, 2 * D)),
        ("o", "{L}self_attn.o_proj.weight", (D, NZ)),
        ("post_attn_norm", "{L}post_attention_layernorm.weight", (D,)),
        ("gate", "{L}mlp.gate_proj.weight", (F, D)),
        ("up", "{L}mlp.up_proj.weight", (F, D)),
        ("down", "{L}mlp.down_proj.weight", (D, F)),
        ("final_norm", "norm.weight", (D,)),
        ("lm_head", "lm_head.weight", (U, D)),
    ]


@dataclasses.dataclass(frozen=True, eq=False)
class Drafter:
    """An EAGLE-3 drafter on its target's mesh. Build with `load_drafter`."""

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
        return Split.plan(self.config, self.mesh.shape[MODEL], self.rules)

    @property
    def param_rules(self) -> ShardingRules:
        """The sharding rules of the drafter's own parameters (heads replicated unless split)."""
        return self.split.rules_for(self.rules)

    def cache_specs(self) -> tuple[P, ...]:
        """PartitionSpecs of the cache arrays. Llama (k, v) [B, S, O, Z]: batch over data, KV heads over model if
        split. MLA (latent [B, S, C+R],): batch over data, the latent shared by all heads."""
        if self.config.mla is not None:
            return (P(self.rules.batch, None, None),)
        return (P(self.rules.batch, None, self.rules.heads if self.split.heads else None, None),) * 2

    def apply(
        self,
        params,
        tokens_BT: jax.Array,
        hidden: jax.Array,
        pos_BT: jax.Array,
        cache: KVCache | None = None,
        *,
        first_step: bool,
    ) -> tuple[jax.Array, jax.Array, KVCache | None]:
        """Sharded drafter step (traceable; call inside jit).

        `hidden` is the captured aux [B,T,X*Dt] (ascending layers, see `concat_captured`) when `first_step`, else
        the previous step's h2 [B,T,D]. Returns (fp32 draft logits [B,T,U], h2 [B,T,D], cache). Cache entries are
        written at `pos_BT` (contiguous per sequence) and attention is causal by position.
        """
        cfg = self.config
        width = len(cfg.capture_layers) * cfg.target_hidden_size if first_step else cfg.hidden_size
        if hidden.shape != (*tokens_BT.shape, width):
            raise ValueError(f"hidden: expected shape {(*tokens_BT.shape, width)}, got {hidden.shape}")
        batch, split = self.rules.batch, self.split
        cache_spec = None if cache is None else self.cache_specs()

        def local(params, tokens, hidden, pos, cache):
            return nnx.merge(self.graphdef, params)(tokens, hidden, pos, cache, first_step=first_step)

        reshard = lambda x, spec: jax.sharding.reshard(x, NamedSharding(self.mesh, spec))  # noqa: E731
        tokens_BT, pos_BT = reshard(tokens_BT, P(batch, None)), reshard(pos_BT, P(batch, None))
        hidden = reshard(hidden, P(batch, None, None))
        cache = None if cache is None else tuple(reshard(c, s) for c, s in zip(cache, cache_spec, strict=True))
        fn = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(
                Target.param_specs(params, self.param_rules),
                P(batch, None),
                P(batch, None, None),
                P(batch, None),
                cache_spec,
            ),
            out_specs=(P(batch, None, self.rules.vocab if split.vocab else None), P(batch, None, None), cache_spec),
        )
        return fn(params, tokens_BT, hidden, pos_BT, cache)

    @classmethod
    def random(
        cls, cfg: Eagle3Config, target: Target, *, d2t: np.ndarray | None = None, dtype=jnp.bfloat16, seed: int = 0
    ) -> Drafter:
        """A randomly initialised drafter for `target` (to train, or as a bad drafter in tests), on its mesh.

        It uses the target's embedding; `d2t` ([draft_vocab] offsets) is required when the draft vocabulary is smaller
        than the target's."""
        if (d2t is None) != cfg.full_vocab:
            raise ValueError("d2t: required exactly when draft_vocab_size < vocab_size")
        split = Split.plan(cfg, target.mesh.shape[MODEL], target.rules)
        graphdef, abstract = nnx.split(
            nnx.eval_shape(lambda: Eagle3Model(cfg, dtype=dtype, split=split, rngs=nnx.Rngs(0)))
        )
        specs = Target.param_specs(abstract, split.rules_for(target.rules))
        shardings = jax.tree.map(lambda spec: NamedSharding(target.mesh, spec), specs)
        make = lambda: nnx.state(Eagle3Model(cfg, dtype=dtype, split=split, rngs=nnx.Rngs(seed)))  # noqa: E731
        params = jax.jit(make, out_shardings=shardings)()
        params["embed"] = params["embed"].replace(target.params["embed"].get_value())
        d2t = None if d2t is None else np.asarray(d2t, np.int32)
        return cls(cfg, target, graphdef, params, d2t, ("embed",))

    # ------------------------------------------------------------------ user entry points
    def logits(self, aux_hidden, token_ids) -> jax.Array:
        """First-step draft logits [B,T,U] (fp32) for a whole sequence, causal, positions 0..T-1, no cache.

        `aux_hidden` [B,T,X*Dt] are the target states of `capture_layers` concatenated low -> high.
        """
        tokens = self._tokens(token_ids)
        return _jit_logits(self, self.params, jnp.asarray(aux_hidden), tokens)

    def aux_hidden(self, token_ids) -> jax.Array:
        """The drafter's first-step input for these tokens: the target's `capture_layers` outputs, [B,T,X*D]."""
        return concat_captured(jnp.stack(self.target.hidden_states(token_ids, self.capture_layers)))

    def forward(self, token_ids, hidden, positions, cache: KVCache, *, first_step: bool):
        """One cached step (see `apply`): returns (logits [B,T,U], h2 [B,T,D], new cache). The cache is donated."""
        tokens = self._tokens(token_ids)
        pos = jnp.asarray(positions, jnp.int32)
        if pos.shape != tokens.shape:
            raise ValueError(f"positions: expected shape {tokens.shape}, got {pos.shape}")
        return _jit_forward(self, self.params, tokens, jnp.asarray(hidden), pos, cache, first_step)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """Zeroed cache in the drafter dtype: Llama (k, v), each [B, S, kv_heads, head_dim]; MLA (latent,)
        [B, S, kv_lora_rank + qk_rope_head_dim]."""
        cfg, specs = self.config, self.cache_specs()
        if cfg.mla is not None:
            shape = (batch, max_len, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
        else:
            shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        return tuple(jax.device_put(jnp.zeros(shape, self.dtype), NamedSharding(self.mesh, s)) for s in specs)

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        """Draft-vocabulary ids -> target ids (`id + d2t[id]`); traceable, also inside shard_map."""
        if self.d2t is None:
            return draft_ids
        draft_ids = jnp.asarray(draft_ids)
        # Explicit-axes meshes need the gather's output sharding stated: it follows the ids (d2t is a constant).
        offsets = jnp.asarray(self.d2t).at[draft_ids].get(out_sharding=jax.typeof(draft_ids).sharding)
        return draft_ids + offsets.astype(draft_ids.dtype)

    def _tokens(self, token_ids) -> jax.Array:
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


# ----------------------------------------------------------------------------------------------- loading
def load_drafter(
    path: str | Path,
    target: Target,
    *,
    capture_convention: Convention | None = None,
    dtype=jnp.bfloat16,
) -> Drafter:
    """Load an HF-layout EAGLE-3 drafter directory (config.json + safetensors) for `target`, on its mesh.

    `capture_convention` ("output" | "input") states how the checkpoint's layer ids are meant when the format does
    not say it unambiguously (or overrides it). Every problem is reported before anything is placed on devices.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"config.json not found in {path}")
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path / 'config.json'}: not valid JSON ({e})") from e
    cfg = Eagle3Config.from_hf_config(raw, target_config=target.config, capture_convention=capture_convention)
    host, d2t = read_tensors(path, cfg, target.config.hidden_size, np.dtype(jnp.dtype(dtype)))

    mesh, shared = target.mesh, tuple(k for k in ("embed", "lm_head") if k not in host)
    split = Split.plan(cfg, mesh.shape[MODEL], target.rules)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Eagle3Model(cfg, dtype=dtype, split=split, rngs=nnx.Rngs(0))))
    rules = split.rules_for(target.rules)

    def place(path_, var):
        if path_[0] in shared:  # the target's embed [V,D] / lm_head [D,V]: same layout and sharding, no copy
            return path_, var.replace(target.params[path_[0]].get_value())
        expect = var.get_value()
        # From host memory straight to the shards (a device array would be resharded by a compiled program).
        arr = np.asarray(host[".".join(map(str, path_))].reshape(expect.shape), np.dtype(expect.dtype))
        spec = rules.spec(var.get_metadata()["logical_axes"])
        return path_, var.replace(jax.device_put(arr, NamedSharding(mesh, spec)))

    params = nnx.from_flat_state([place(p, v) for p, v in nnx.to_flat_state(abstract)])
    d2t = None if d2t is None else d2t.astype(np.int32)  # offsets < vocab size
    return Drafter(cfg, target, graphdef, params, d2t, shared)


def read_tensors(
    path: str | Path, cfg: Eagle3Config, target_hidden: int, dtype: np.dtype
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """Read and check every tensor: {param name: HF weight transposed (vectors as-is)} in `dtype`, and d2t.

    Raises CheckpointError listing every missing, unexpected, mis-shaped or inconsistent tensor.
    """
    ckpt = SafetensorsDir(path)
    names, used, problems = set(ckpt.names()), set(), []
    prefixes = [p for p in dict.fromkeys(LAYER_PREFIX.values()) if any(n.startswith(p) for n in names)]
    if len(prefixes) > 1:
        problems.append(f"both {' and '.join(p + '*' for p in prefixes)} tensors present; expected one layer prefix")
    prefix = prefixes[0] if prefixes else LAYER_PREFIX[cfg.format]

    def get(name: str, shape: tuple[int, ...], hint: str = "") -> np.ndarray | None:
        if name not in names:
            problems.append(f"missing tensor {name} (expected shape {list(shape)}){hint}")
            return None
        used.add(name)
        if ckpt.shape(name) != shape:
            problems.append(f"{name}: expected shape {list(shape)}{hint}, got {list(ckpt.shape(name))}")
            return None
        return ckpt.get(name)

    host: dict[str, np.ndarray] = {}
    X = len(cfg.capture_layers)
    for key, name, shape in _table(cfg):
        hint = f" ({X} captured states x target hidden_size {cfg.target_hidden_size})" if key == "fc" else ""
        if key == "lm_head" and cfg.full_vocab and name not in names and cfg.hidden_size == target_hidden:
            continue  # no draft vocabulary and no head: use the target's lm_head, as SGLang does
        w = get(name.format(L=prefix), shape, hint)
        if w is not None:
            host[key] = np.asarray(w.T, dtype)
    for name, shape, to_ours, _ in [] if cfg.mla is None else _mla_table(cfg):
        w = get(name.format(L=prefix), shape)
        if w is not None:
            host.update({key: np.asarray(v, dtype) for key, v in to_ours(w).items()})
    V, U = cfg.vocab_size, cfg.draft_vocab_size
    if "embed_tokens.weight" in names:
        w = get("embed_tokens.weight", (V, cfg.hidden_size))
        if w is not None and not all(np.isfinite(w[i : i + 4096]).all() for i in range(0, V, 4096)):  # bounded temp
            problems.append("embed_tokens.weight: contains non-finite values (a never-loaded placeholder?)")
        elif w is not None:
            host["embed"] = np.asarray(w, dtype)
    elif cfg.hidden_size != target_hidden:
        problems.append(
            f"hidden_size: drafter {cfg.hidden_size} != target {target_hidden}, and the checkpoint ships no "
            "embed_tokens.weight, so the target's embedding cannot be reused"
        )

    d2t = None
    if "d2t" in names or not cfg.full_vocab:
        d2t = get("d2t", (U,), "" if cfg.full_vocab else f" (draft_vocab_size {U} < vocab_size {V} needs the map)")
    if d2t is not None:
        ids = np.arange(U) + d2t.astype(np.int64)
        if not np.issubdtype(d2t.dtype, np.integer) or ids.min() < 0 or ids.max() >= V or len(np.unique(ids)) < U:
            problems.append(f"d2t: draft id + d2t must be distinct target ids in [0, {V}) (dtype {d2t.dtype})")
            d2t = None
    if "t2d" in names:
        t2d = get("t2d", (V,))
        if t2d is not None and d2t is not None:
            expected = np.zeros(V, bool)
            expected[np.arange(U) + d2t] = True
            if not np.array_equal(t2d.astype(bool), expected):
                problems.append("t2d: disagrees with d2t (t2d must mark exactly the targets of draft ids)")

    unexpected = sorted(n for n in names - used if n not in IGNORED and not n.endswith("rotary_emb.inv_freq"))
    problems += [f"unexpected tensor {n}" for n in unexpected]
    if problems:
        raise CheckpointError(
            f"{path}: {len(problems)} problem(s) with the drafter checkpoint:\n  " + "\n  ".join(problems)
        )
    return host, d2t


# ----------------------------------------------------------------------------------------------- writing
def save_drafter(drafter: Drafter, path: str | Path, *, format: Format, verifier: str | None = None) -> None:
    """Write `drafter` as an HF-layout directory in the SGLang/SpecForge or speculators/vLLM format.

    Layer ids are written in the format's own convention (SGLang: outputs of k; speculators: inputs of k + 1). The
    embedding is written only when the drafter has its own (every engine takes it from the target otherwise); the
    lm_head always is (speculators requires it), even when it is the target's.
    `verifier` is the target's name or path, recorded in the speculators config (its loader reads the target).
    """
    if format not in LAYER_PREFIX:
        raise ValueError(f"format: expected one of {sorted(LAYER_PREFIX)}, got {format!r}")
    cfg, path = drafter.config, Path(path)
    if (cfg.mla is not None) != (format == "mla"):
        raise ValueError(
            f"format: {format!r} cannot hold this drafter (an MLA drafter is written as 'mla', "
            "Eagle3DeepseekV2ForCausalLM; a Llama drafter as 'sglang' or 'speculators')"
        )

    def host(key: str) -> np.ndarray:
        var = drafter.params
        for k in key.split("."):
            var = var[k]
        return np.asarray(jax.device_get(var.get_value()))

    prefix = LAYER_PREFIX[format]
    tensors = {
        name.format(L=prefix): np.ascontiguousarray(host(key).reshape(shape[::-1]).T)
        for key, name, shape in _table(cfg)
    }
    for name, _, _, to_hf in [] if cfg.mla is None else _mla_table(cfg):
        tensors[name.format(L=prefix)] = np.ascontiguousarray(to_hf(host))
    if "embed" not in drafter.shared:
        tensors["embed_tokens.weight"] = host("embed")
    if drafter.d2t is not None:
        d2t = drafter.d2t.astype(np.int64)
        tensors["d2t"] = d2t
        tensors["t2d"] = np.zeros(cfg.vocab_size, bool)
        tensors["t2d"][np.arange(cfg.draft_vocab_size) + d2t] = True
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(cfg, format, drafter.dtype, verifier), indent=2) + "\n")


def _mla_hf_config(cfg: Eagle3Config, layer: dict[str, Any], dtype_name: str) -> dict[str, Any]:
    """vLLM's Eagle3DeepseekV2ForCausalLM layout: DeepSeek-V3 attention fields; layer ids as inputs of layer k + 1."""
    m = cfg.mla
    rope = None
    if m.rope_scaling is not None:
        rope = {"type": "yarn", **{k: v for k, v in dataclasses.asdict(m.rope_scaling).items() if v is not None}}
    return {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        **{k: v for k, v in layer.items() if k not in ("head_dim", "num_key_value_heads")},
        "model_type": "deepseek_v3",
        "num_key_value_heads": m.num_attention_heads,
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "rope_theta": m.rope_theta,
        "rope_scaling": rope,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "torch_dtype": dtype_name,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [k + 1 for k in cfg.capture_layers],
            "use_aux_hidden_state": True,
        },
    }


def hf_config(cfg: Eagle3Config, format: Format, dtype=jnp.bfloat16, verifier: str | None = None) -> dict[str, Any]:
    """config.json contents for `cfg` in the given format (the inverse of `Eagle3Config.from_hf_config`)."""
    layer = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    rope, dtype_name = cfg.rope.to_hf(), jnp.dtype(dtype).name
    if format == "mla":
        return _mla_hf_config(cfg, layer, dtype_name)
    common = {
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
    }
    if format == "sglang":
        theta = rope.pop("rope_theta")
        return {
            "architectures": [SGLANG_ARCHITECTURE],
            **layer,
            "rope_theta": theta,
            "rope_scaling": None if rope["rope_type"] == "default" else rope,
            **common,
            "torch_dtype": dtype_name,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(cfg.capture_layers),
                "use_aux_hidden_state": True,
            },
        }
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": SPECULATORS_TYPE,
        **common,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "eagle_aux_hidden_state_layer_ids": [k + 1 for k in cfg.capture_layers],  # inputs of layer k + 1
        "transformer_layer_config": {**layer, "rope_parameters": rope},
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": verifier, "architectures": ["DeepseekV3ForCausalLM"]},
        },
        "dtype": dtype_name,
        "tie_word_embeddings": False,
    }
