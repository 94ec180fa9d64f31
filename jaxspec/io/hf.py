"""Reading HF-layout checkpoints (config.json + safetensors) into the model's parameter tree.

One name table (`top_table`, `layer_table`, `expert_tensors`) maps every HF tensor to the parameter(s) of `KimiModel`
it holds, with the reshape from PyTorch's [out, in] layout to ours and back: `read_params` reads through it and
`jaxspec.io.export` writes through it. The reader is lazy (safetensors `safe_open`, index-driven), checks every
shape before reading data, and reports every missing, unexpected and mis-shaped tensor in one error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open

from jaxspec.config import KimiConfig
from jaxspec.io.compressed_tensors import unpack_int4
from jaxspec.models.kimi import KimiModel
from jaxspec.models.moe import EXPERT_PROJS
from jaxspec.models.quant import Fp8Array, Int4Array
from jaxspec.pytree import flatten, get_path, set_path

# K2.5 is multimodal: vision tensors are skipped (vision is out of scope) and the text model's prefix is stripped.
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
TEXT_PREFIX = "language_model."


SCALE_SUFFIX = "_scale_inv"  # an FP8 block checkpoint's X.weight -> X.weight_scale_inv
# safetensors dtype names -> numpy dtypes
DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}
# safetensors dtype names per kind of tensor: float weights (FP8 ones kept FP8 or dequantised: `Reader`) and integers.
DTYPE_KINDS = {
    "float": ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"),
    "int": ("I64", "I32", "I16", "I8", "U8"),
}


class CheckpointError(ValueError):
    """A checkpoint that does not match the config; the message lists every problem at once."""


class SafetensorsDir:
    """Lazy access to the tensors of an HF checkpoint directory (single file or sharded with an index)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.files = {name: self.path / f for name, f in _read_index(index).items()}
            root = self.path.resolve()
            outside = sorted({str(f) for f in set(self.files.values()) if not f.resolve().is_relative_to(root)})
            if outside:
                raise CheckpointError(f"{index}: weight_map points outside the checkpoint directory: {outside}")
            missing_files = sorted({str(f) for f in self.files.values() if not f.is_file()})
            if missing_files:
                raise FileNotFoundError(f"{index} refers to missing shard files: {missing_files}")
            for f in sorted(set(self.files.values())):  # each header once: the index must agree with the files
                listed = {n for n, g in self.files.items() if g == f}
                absent = sorted(listed - set(_header_names(f)))
                if absent:
                    raise CheckpointError(f"{index}: maps {absent[:5]} to {f.name}, which does not contain them")
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files or index in {self.path}")
            self.files = {}
            for f in files:
                self.files.update((name, f) for name in _header_names(f))
        self._handles: dict[Path, Any] = {}

    def names(self) -> list[str]:
        return list(self.files)

    def _open(self, name: str):
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = safe_open(f, "numpy")
        return self._handles[f]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it ("BF16", "F32", "I32", ...)."""
        return self._open(name).get_slice(name).get_dtype()

    def get(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor as stored (copied into `out`, and returned, if given)."""
        w = self._open(name).get_tensor(name)
        if out is None:
            return w
        if out.shape != w.shape or out.dtype != w.dtype:
            raise ValueError(
                f"{name}: out must be a {w.dtype} array of shape {list(w.shape)}, got {out.dtype} {list(out.shape)}"
            )
        np.copyto(out, w)
        return out


def _read_index(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index}: not valid JSON ({e})") from e
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: expected an object with a 'weight_map' of tensor name -> file name")
    return weight_map


def _header_names(f: Path) -> list[str]:
    try:
        with safe_open(f, "numpy") as h:
            return list(h.keys())
    except Exception as e:  # safetensors raises its own error types, which name no file
        raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from e


def text_names(ckpt: SafetensorsDir) -> tuple[dict[str, str], int]:
    """Map text-model names (prefix stripped) to stored names; count skipped vision tensors."""
    out, skipped = {}, 0
    for stored in ckpt.names():
        name = stored[len(TEXT_PREFIX) :] if stored.startswith(TEXT_PREFIX) else stored
        if name.startswith(SKIPPED_PREFIXES):
            skipped += 1
            continue
        out[name] = stored
    return out, skipped


# ----------------------------------------------------------------------------------------------- name table
class Tensor(NamedTuple):
    """One HF tensor and the parameters it holds: the name table's row, read by `read_params` and written by
    `jaxspec.io.export`. `to_ours(w)` splits the HF array into one array per path in `params` (our layout);
    `to_hf(*ours)` joins them back (its exact inverse)."""

    hf: str  # full name at the top level, the suffix after `model.layers.{i}.` within a layer
    shape: tuple[int, ...]  # HF shape ([out, in] for a linear weight)
    params: tuple[tuple[str, ...], ...]  # our parameter paths (within the layer for a layer row)
    to_ours: Callable[..., tuple[np.ndarray, ...]]
    to_hf: Callable[..., np.ndarray]
    # declared float32 by the model (the router's score-correction bias): read, converted and written as float32
    # whatever the compute or checkpoint dtype, so its stored values stay bit-exact
    fp32: bool = False


def _vector(path: tuple[str, ...], hf: str, shape: tuple[int, ...], fp32: bool = False) -> Tensor:
    return Tensor(hf, shape, (path,), lambda w: (w,), lambda w: w, fp32)


def _linear(path: tuple[str, ...], hf: str, shape: tuple[int, ...]) -> Tensor:
    """PyTorch [out, in] <-> our [in, out]."""
    return Tensor(hf, shape, (path,), lambda w: (w.T,), lambda w: np.asarray(w).T)


def _heads(paths: tuple[tuple[str, ...], ...], hf: str, shape: tuple[int, ...], widths: tuple[int, ...]) -> Tensor:
    """HF rows [N * sum(widths), in] (head-major) <-> one per-head block [in, N, width] per path."""
    n, bounds = shape[0] // sum(widths), np.cumsum((0, *widths))

    def to_ours(w):
        w = w.reshape(n, sum(widths), -1)
        return tuple(w[:, lo:hi].transpose(2, 0, 1) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True))

    def to_hf(*parts_INH):
        w_INH = np.concatenate([np.asarray(p) for p in parts_INH], axis=-1)
        return w_INH.transpose(1, 2, 0).reshape(n * sum(widths), w_INH.shape[0])

    return Tensor(hf, shape, paths, to_ours, to_hf)


def top_table(cfg: KimiConfig) -> list[Tensor]:
    """The weights outside the decoder layers. A tied head is the embedding's transpose (one HF tensor)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    if cfg.tie_word_embeddings:
        embed = Tensor("model.embed_tokens.weight", (V, D), (("embed",), ("lm_head",)), lambda w: (w, w.T), _first)
        return [embed, _vector(("final_norm",), "model.norm.weight", (D,))]
    return [
        _vector(("embed",), "model.embed_tokens.weight", (V, D)),
        _vector(("final_norm",), "model.norm.weight", (D,)),
        _linear(("lm_head",), "lm_head.weight", (V, D)),
    ]


def _first(w, *_):
    return w


def _query_table(cfg: KimiConfig) -> list[Tensor]:
    """q_a / q_a_layernorm / q_b with a query latent, a single q_proj without one."""
    D, Q = cfg.hidden_size, cfg.q_lora_rank
    N, H, R = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    if not cfg.q_lora:
        return [_heads((("attn", "q_nope"), ("attn", "q_rope")), "self_attn.q_proj.weight", (N * (H + R), D), (H, R))]
    return [
        _linear(("attn", "q_a"), "self_attn.q_a_proj.weight", (Q, D)),
        _vector(("attn", "q_a_norm"), "self_attn.q_a_layernorm.weight", (Q,)),
        _heads((("attn", "q_b_nope"), ("attn", "q_b_rope")), "self_attn.q_b_proj.weight", (N * (H + R), Q), (H, R)),
    ]


def _attn_table(cfg: KimiConfig) -> list[Tensor]:
    """Attention and the layer norms."""
    D, C = cfg.hidden_size, cfg.kv_lora_rank
    N, H, R, A = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    kv_a = Tensor(
        "self_attn.kv_a_proj_with_mqa.weight",
        (C + R, D),
        (("attn", "kv_a_latent"), ("attn", "kv_a_rope")),
        lambda w: (w[:C].T, w[C:].T),
        lambda latent, rope: np.concatenate([np.asarray(latent), np.asarray(rope)], axis=1).T,
    )
    o = Tensor(
        "self_attn.o_proj.weight",
        (D, N * A),
        (("attn", "o"),),
        lambda w: (w.reshape(D, N, A).transpose(1, 2, 0),),
        lambda w: np.asarray(w).transpose(2, 0, 1).reshape(D, N * A),
    )
    return [
        _vector(("input_norm",), "input_layernorm.weight", (D,)),
        _vector(("post_attn_norm",), "post_attention_layernorm.weight", (D,)),
        *_query_table(cfg),
        kv_a,
        _vector(("attn", "kv_a_norm"), "self_attn.kv_a_layernorm.weight", (C,)),
        _heads((("attn", "kv_b_k"), ("attn", "kv_b_v")), "self_attn.kv_b_proj.weight", (N * (H + A), C), (H, A)),
        o,
    ]


def _mlp_table(prefix: str, hidden: int, inner: int, path: tuple[str, ...]) -> list[Tensor]:
    return [
        _linear((*path, "gate"), f"{prefix}.gate_proj.weight", (inner, hidden)),
        _linear((*path, "up"), f"{prefix}.up_proj.weight", (inner, hidden)),
        _linear((*path, "down"), f"{prefix}.down_proj.weight", (hidden, inner)),
    ]


def layer_table(cfg: KimiConfig, moe: bool) -> list[Tensor]:
    """Every tensor of one decoder layer except the routed experts (see `expert_name`), in checkpoint order."""
    D, E, F = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    table = _attn_table(cfg)
    if not moe:
        return table + _mlp_table("mlp", D, cfg.intermediate_size, ("mlp",))
    return table + [
        _linear(("mlp", "router"), "mlp.gate.weight", (E, D)),
        _vector(("mlp", "router_bias"), "mlp.gate.e_score_correction_bias", (E,), fp32=True),
        *_mlp_table("mlp.shared_experts", D, F * cfg.n_shared_experts, ("mlp", "shared")),
    ]


def expert_name(layer: int, e: int, proj: str) -> str:
    """HF name prefix of one routed expert's projection (add `.weight`, or `.weight_packed` etc. for INT4)."""
    return f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj"


def expert_tensors(cfg: KimiConfig, layer: int, proj: str, e: int, int4: bool) -> dict[str, tuple[int, ...]]:
    """{HF name: HF shape} of one routed expert's projection: `weight` [out, in], or INT4 compressed-tensors
    `weight_packed` [out, in/8] int32, `weight_scale` [out, in/group] and `weight_shape` [2]."""
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    out_f, in_f = (D, F) if proj == "down" else (F, D)
    base = expert_name(layer, e, proj)
    if not int4:
        return {f"{base}.weight": (out_f, in_f)}
    g = cfg.quant.group_size
    return {
        f"{base}.weight_packed": (out_f, in_f // 8),
        f"{base}.weight_scale": (out_f, in_f // g),
        f"{base}.weight_shape": (2,),
    }


def expected_tensors(cfg: KimiConfig, int4: bool) -> dict[str, tuple[int, ...]]:
    """{HF name: HF shape} of every tensor the text model reads."""
    out = {row.hf: row.shape for row in top_table(cfg)}
    for layer in range(cfg.num_hidden_layers):
        moe = layer >= cfg.first_k_dense_replace
        out.update({f"model.layers.{layer}.{row.hf}": row.shape for row in layer_table(cfg, moe)})
        for e in range(cfg.n_routed_experts if moe else 0):
            for proj in EXPERT_PROJS:
                out.update(expert_tensors(cfg, layer, proj, e, int4))
    return out


def block_scales(
    to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]],
    hf_shape: tuple[int, int],
    block: tuple[int, int],
    scale_inv: np.ndarray,
    blocks: list[tuple[int, ...]],
    name: str,
) -> list[np.ndarray]:
    """The scales of each part `to_ours` makes of an FP8 weight [out, in] (the name table's transform), in our layout
    with the given `blocks` per axis. The transform only splits, slices and transposes, so applied to broadcast row
    and column indices it returns views (nothing the weight's size is allocated); each of our blocks is checked to
    lie in one of the checkpoint's (its first and last element in the same one)."""
    (R, C), (br, bc) = hf_shape, block
    rows = to_ours(np.broadcast_to(np.arange(R)[:, None], (R, C)))
    cols = to_ours(np.broadcast_to(np.arange(C)[None, :], (R, C)))
    out = []
    for r, c, b in zip(rows, cols, blocks, strict=True):
        first = tuple(slice(None, None, k) for k in b)
        last = np.ix_(*(np.minimum(np.arange(0, d, k) + k - 1, d - 1) for d, k in zip(r.shape, b, strict=True)))
        r0, c0 = r[first] // br, c[first] // bc
        if (r0 != r[last] // br).any() or (c0 != c[last] // bc).any():
            raise CheckpointError(f"{name}: blocks {list(b)} of our layout {list(r.shape)} cross {br}x{bc} blocks")
        out.append(scale_inv[r0, c0])
    return out


def model_fp8_blocks(cfg: KimiConfig, int4_experts: bool) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{parameter path (within its decoder layer for stacked ones): FP8 blocks} of every weight `KimiModel` keeps
    FP8 (from the abstract model: nothing allocated); empty for a config without FP8."""
    if cfg.fp8 is None:
        return {}
    model = nnx.eval_shape(lambda: KimiModel(cfg, dtype=jnp.float32, int4_experts=int4_experts, rngs=nnx.Rngs(0)))
    return {
        path[1:] if path[0] in ("dense_layers", "moe_layers") else path: var.get_value().blocks
        for path, var in nnx.to_flat_state(nnx.state(model))
        if isinstance(var.get_value(), Fp8Array)
    }


# ----------------------------------------------------------------------------------------------- loading
class Reader:
    """Reads tensors by text-model name, recording what was used and every problem.

    `fp8_blocks` ({parameter path: blocks}, `model_fp8_blocks`) names the parameters the model keeps FP8: those are
    read as `Fp8Array`s from an FP8 checkpoint's reader (`jaxspec.io.fp8.Fp8Dir`); any other FP8 weight arrives
    dequantised."""

    def __init__(self, ckpt: SafetensorsDir, fp8_blocks: Mapping[tuple[str, ...], tuple[int, ...]] | None = None):
        self.ckpt = ckpt
        self.names, self.skipped = text_names(ckpt)
        self.used: set[str] = set()
        self.problems: list[str] = []
        self.fp8_blocks = dict(fp8_blocks or {})

    def get(
        self, name: str, shape: tuple[int, ...], kind: str = "float", out: np.ndarray | None = None
    ) -> np.ndarray | None:
        """The tensor, or None after recording why not; `kind` is "float" (weights, scales) or "int" (packed).
        With `out` (its shape, in the stored dtype `ckpt.dtype` names), the tensor is read into it."""
        stored = self.check(name, shape, kind)
        if stored is None:
            return None
        return self.ckpt.get(stored) if out is None else self.ckpt.get(stored, out)

    def check(self, name: str, shape: tuple[int, ...], kind: str = "float") -> str | None:
        """The stored name of a tensor present with this shape and a dtype of this kind (marked used), or None after
        recording why not: what `get` checks before reading."""
        if name not in self.names:
            self.problems.append(f"missing tensor {name} (expected shape {list(shape)})")
            return None
        self.used.add(name)
        actual = self.ckpt.shape(self.names[name])
        if actual != tuple(shape):
            self.problems.append(f"{name}: expected shape {list(shape)}, got {list(actual)}")
            return None
        stored = self.ckpt.dtype(self.names[name])
        if stored not in DTYPE_KINDS[kind]:
            self.problems.append(f"{name}: expected a {kind} dtype ({'/'.join(DTYPE_KINDS[kind])}), got {stored}")
            return None
        return self.names[name]

    def rows(self, table: list[Tensor], cast: Callable, prefix: str = "") -> dict[str, Any]:
        """A nested dict of every parameter in `table` (cast; float32 rows as float32), None where its tensor had a
        problem (recorded)."""
        out: dict[str, Any] = {}
        for row in table:
            if row.params[0] in self.fp8_blocks:
                ours = self.fp8_row(row, prefix)
            else:
                w = self.get(prefix + row.hf, row.shape)
                keep = (lambda a: np.asarray(a, np.float32)) if row.fp32 else cast
                ours = None if w is None else tuple(keep(v) for v in row.to_ours(w))
            for path, value in zip(row.params, ours or (None,) * len(row.params), strict=True):
                set_path(out, path, value)
        return out

    def fp8_row(self, row: Tensor, prefix: str = "") -> tuple[Fp8Array, ...] | None:
        """The row's parameters as `Fp8Array`s: the stored float8 values in our layout and their block scales; None
        after recording why not."""
        stored = self.check(prefix + row.hf, row.shape)
        parts = None if stored is None else self.fp8_parts(stored)
        if parts is None:
            return None
        blocks = [self.fp8_blocks[p] for p in row.params]
        scales = block_scales(row.to_ours, row.shape, self.ckpt.block, parts[1], blocks, prefix + row.hf)
        values = row.to_ours(parts[0])
        return tuple(Fp8Array(v, s, b) for v, s, b in zip(values, scales, blocks, strict=True))

    def fp8_parts(self, stored: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(values, scale_inv) of a weight the model keeps FP8; None after recording that it is not stored so."""
        parts = self.ckpt.fp8_parts(stored) if hasattr(self.ckpt, "fp8_parts") else None
        if parts is None:
            self.problems.append(
                f"{stored}: the model keeps it FP8 (quantization_config fp8), but it is stored as "
                f"{self.ckpt.dtype(stored)} without a {SCALE_SUFFIX}"
            )
        return parts


def read_params(ckpt: SafetensorsDir, cfg: KimiConfig, *, int4_experts: bool, dtype: np.dtype) -> dict[str, Any]:
    """Read an HF checkpoint into a nested dict shaped like `nnx.state(KimiModel)` (numpy leaves).

    `ckpt` is the directory's reader (`jaxspec.io.fp8.open_checkpoint`). Weights are cast to `dtype`, except: INT4
    experts stay 4-bit (`Int4Array`) with their stored scales; with `cfg.fp8`, block-FP8 weights stay FP8
    (`Fp8Array`) with theirs (without it, an FP8 checkpoint's weights arrive dequantised to `dtype`).
    """
    dtype = np.dtype(dtype)
    reader = Reader(ckpt, model_fp8_blocks(cfg, int4_experts))
    params = reader.rows(top_table(cfg), caster(dtype))
    k = cfg.first_k_dense_replace
    for stack, layers, moe in (
        ("dense_layers", range(k), False),
        ("moe_layers", range(k, cfg.num_hidden_layers), True),
    ):
        if not layers:
            continue
        per_layer = [read_layer(reader, cfg, i, moe, int4_experts, dtype) for i in layers]
        params[stack] = _stack(per_layer)

    unexpected = sorted(n for n in set(reader.names) - reader.used if not is_ignorable(n, cfg, reader.names))
    problems = reader.problems + [f"unexpected tensor {n}" for n in unexpected]
    if problems:
        raise CheckpointError(
            f"{ckpt.path}: {len(problems)} problem(s) with the checkpoint:\n  " + "\n  ".join(problems)
        )
    return params


# What a DeepSeek-V3 multi-token-prediction layer holds: a full decoder layer plus its own norms, projection, and
# (copies of) the embedding and head. FP8 checkpoints add a weight_scale_inv per matrix.
_MTP_SUFFIX = re.compile(
    r"(input_layernorm|post_attention_layernorm|enorm|hnorm|eh_proj|embed_tokens|shared_head\.(norm|head)"
    r"|self_attn\.(q_proj|q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj|o_proj)"
    r"|mlp\.(gate_proj|up_proj|down_proj|gate|shared_experts\.(gate|up|down)_proj|experts\.\d+\.(gate|up|down)_proj))"
    r"\.(weight|weight_scale_inv|e_score_correction_bias|weight_packed|weight_scale|weight_shape)"
)


def is_ignorable(name: str, cfg: KimiConfig, names: Collection[str] | None = None) -> bool:
    """Rotary buffers, and the tensors of the config's MTP layers (model.layers.{L .. L+n-1}), which the text model
    does not use. Anything else past the last decoder layer is unexpected: weights for layers the config lacks.
    With `names` (every tensor in the checkpoint), an MTP layer must also hold its defining `eh_proj`, so a config
    whose num_hidden_layers is one short is not mistaken for one with an MTP layer."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    L = cfg.num_hidden_layers
    if not (m and L <= int(m.group(1)) < L + cfg.num_nextn_predict_layers and _MTP_SUFFIX.fullmatch(m.group(2))):
        return False
    return names is None or f"model.layers.{m.group(1)}.eh_proj.weight" in names


def read_layer(reader: Reader, cfg: KimiConfig, layer: int, moe: bool, int4: bool, dtype: np.dtype) -> dict[str, Any]:
    """One decoder layer's parameters as a nested dict in our layout, cast to `dtype` (None where a tensor had a
    problem, recorded in `reader`); INT4 experts stay INT4."""
    dtype = np.dtype(dtype)
    out = reader.rows(layer_table(cfg, moe), caster(dtype), prefix=f"model.layers.{layer}.")
    if moe and int4:
        for proj in EXPERT_PROJS:
            set_path(out, ("mlp", proj), _read_int4_experts(reader, cfg, layer, proj))
    elif moe and reader.fp8_blocks:  # read in the checkpoint's [E, out, in]; ours is [E, in, out]
        for proj, stacks in read_fp8_experts(reader, cfg, layer).items():
            w = None if stacks is None else Fp8Array(*(a.transpose(0, 2, 1) for a in stacks), cfg.fp8.block[::-1])
            set_path(out, ("mlp", proj), w)
    elif moe:  # read in the checkpoint's [E, out, in]; ours is [E, in, out]
        for proj, w in read_float_experts(reader, cfg, layer, dtype).items():
            set_path(out, ("mlp", proj), None if w is None else np.ascontiguousarray(w.transpose(0, 2, 1)))
    return out


def caster(dtype: np.dtype) -> Callable[[Any], np.ndarray | None]:
    """`Reader.rows`' cast to `dtype` (no copy when already there); None (a recorded problem) stays None."""
    return lambda a: None if a is None else np.asarray(a).astype(dtype, copy=False)


def _read_int4_experts(reader: Reader, cfg: KimiConfig, layer: int, proj: str) -> Int4Array | None:
    """Stack one projection of all INT4 experts to our [E, in, out] layout (INT4 stays INT4)."""
    mats, scales = [], []
    for e in range(cfg.n_routed_experts):
        names = expert_tensors(cfg, layer, proj, e, True)
        (packed_name, packed_shape), (scale_name, scale_shape), (shape_name, _) = names.items()
        packed = reader.get(packed_name, packed_shape, "int")
        scale = reader.get(scale_name, scale_shape)
        shape = reader.get(shape_name, (2,), "int")
        out_f, in_f = packed_shape[0], packed_shape[1] * 8
        if shape is not None and tuple(int(s) for s in shape) != (out_f, in_f):
            reader.problems.append(f"{shape_name}: expected [{out_f}, {in_f}], got {shape.tolist()}")
        if packed is None or scale is None:
            mats.append(None)
            continue
        mats.append(unpack_int4(packed, in_f).T)
        scales.append(scale.T)
    if any(m is None for m in mats):
        return None
    # Scales keep their stored dtype: a weight is bf16(q * scale) whatever the compute dtype (see quant.py).
    return Int4Array.from_values(np.stack(mats), np.stack(scales), cfg.quant.group_size)


def read_float_experts(
    reader: Reader, cfg: KimiConfig, layer: int, dtype: np.dtype, take: Callable[..., np.ndarray] = np.empty
) -> dict[str, np.ndarray | None]:
    """{projection: every routed expert's weight as [E, out, in] in `dtype` (the checkpoint's layout, in arrays from
    `take(shape, dtype)`), or None if any had a problem (recorded)}.

    Tensors are read in file order (HF names sort experts 0, 1, 10, 100, ... and interleave the projections; read
    in expert order, the kernel's readahead saw a scattered pattern and the read ran at a third of the disk's speed).
    An expert stored in `dtype` is read straight into its slot (one copy, no transpose); others are read, then cast.
    """
    E = cfg.n_routed_experts
    rows = {p: [next(iter(expert_tensors(cfg, layer, p, e, False).items())) for e in range(E)] for p in EXPERT_PROJS}
    stacks = {p: take((E, *r[0][1]), dtype) for p, r in rows.items()}
    complete = dict.fromkeys(EXPERT_PROJS, True)
    order = sorted(
        ((p, e) for p in EXPERT_PROJS for e in range(E)), key=lambda pe: _location(reader, rows[pe[0]][pe[1]][0])
    )
    bulk, batch = getattr(reader.ckpt, "read_many", None), []
    for proj, e in order:
        name, shape = rows[proj][e]
        stored = reader.names.get(name)
        kind = None if stored is None or stored + SCALE_SUFFIX in reader.ckpt.files else reader.ckpt.dtype(stored)
        direct = kind in DTYPES and np.dtype(DTYPES[kind]) == dtype  # else FP8 (dequantised), cast, or missing
        if direct and bulk is not None:  # checked now, read below in one pass over the files
            checked = reader.check(name, shape)
            complete[proj] &= checked is not None
            batch += [] if checked is None else [(checked, stacks[proj][e])]
            continue
        w = reader.get(name, shape, out=stacks[proj][e] if direct else None)
        if w is None:
            complete[proj] = False
        elif not direct:
            np.copyto(stacks[proj][e], w, casting="unsafe")
    if batch:
        bulk(batch)
    return {p: stacks[p] if complete[p] else None for p in EXPERT_PROJS}


def read_fp8_experts(
    reader: Reader, cfg: KimiConfig, layer: int, take: Callable[..., np.ndarray] = np.empty
) -> dict[str, tuple[np.ndarray, np.ndarray] | None]:
    """{projection: every routed expert's (float8 values [E, out, in], float32 scale_inv [E, out/br, in/bc]) as
    stored (arrays from `take(shape, dtype)`), or None if any had a problem (recorded)}; read in file order, in one
    `read_many` pass where the reader has it."""
    E, (br, bc) = cfg.n_routed_experts, cfg.fp8.block
    out: dict[str, tuple[np.ndarray, np.ndarray] | None] = {}
    batch: list[tuple[str, np.ndarray]] = []
    for proj in EXPERT_PROJS:
        rows = [next(iter(expert_tensors(cfg, layer, proj, e, False).items())) for e in range(E)]
        (r, c) = rows[0][1]
        values, scales = take((E, r, c), ml_dtypes.float8_e4m3fn), take((E, -(-r // br), -(-c // bc)), np.float32)
        complete = True
        for e, (name, shape) in enumerate(rows):
            stored = reader.check(name, shape)
            parts = None if stored is None else _fp8_stored(reader, stored, values[e], scales[e])
            complete &= parts is not None
            batch += parts or []
        out[proj] = (values, scales) if complete else None
    bulk = getattr(reader.ckpt, "read_many", None)
    if bulk is not None:
        bulk(batch)
    else:
        for name, into in batch:
            reader.ckpt.get(name, into)
    return out


def _fp8_stored(reader: Reader, stored: str, values: np.ndarray, scale: np.ndarray) -> list | None:
    """[(weight, its values slot), (scale, its slot)] of a stored FP8 expert weight, every dtype and shape checked;
    None after recording why not."""
    scale_name, problems = stored + SCALE_SUFFIX, []
    if reader.ckpt.dtype(stored) != "F8_E4M3":
        problems.append(f"{stored}: expected F8_E4M3 (quantization_config fp8), got {reader.ckpt.dtype(stored)}")
    elif scale_name not in reader.ckpt.files:
        problems.append(f"{stored}: an FP8 weight without its {scale_name} tensor")
    elif reader.ckpt.shape(scale_name) != scale.shape or reader.ckpt.dtype(scale_name) != "F32":
        problems.append(
            f"{scale_name}: expected F32 {list(scale.shape)}, got {reader.ckpt.dtype(scale_name)} "
            f"{list(reader.ckpt.shape(scale_name))}"
        )
    reader.problems += problems
    return None if problems else [(stored, values), (scale_name, scale)]


def _location(reader: Reader, name: str) -> tuple[str, int]:
    """(file, byte offset) of a tensor where the reader knows it, for reading in file order; missing ones last."""
    stored = reader.names.get(name)
    if stored is None:
        return ("\uffff", 0)
    where = getattr(reader.ckpt, "location", None)
    return where(stored) if where is not None else (str(reader.ckpt.files[stored]), 0)


def _stack(per_layer: list[dict]) -> dict:
    """Stack per-layer dicts on a new leading axis; None where any layer had a problem (already reported)."""
    out: dict = {}
    for path, first in flatten(per_layer[0]):
        vals = [get_path(layer, path) for layer in per_layer]
        if any(v is None for v in vals):
            set_path(out, path, None)
        elif isinstance(first, Int4Array):
            packed, scale = np.stack([v.packed for v in vals]), np.stack([v.scale for v in vals])
            set_path(out, path, Int4Array(packed, scale, first.group_size))
        elif isinstance(first, Fp8Array):
            values, scale = np.stack([v.values for v in vals]), np.stack([v.scale for v in vals])
            set_path(out, path, Fp8Array(values, scale, first.blocks))
        else:
            set_path(out, path, np.stack(vals))
    return out
