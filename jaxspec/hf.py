"""Reading HF-layout checkpoints (config.json + safetensors) into the model's parameter tree.

One name table maps every parameter of `KimiModel` to its HF tensor(s) and the reshape that turns PyTorch's
[out, in] layout into ours. The reader is lazy (safetensors `safe_open`, index-driven), checks every shape before
reading data, and reports every missing, unexpected and mis-shaped tensor in one error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from jaxspec.compressed_tensors import unpack_int4
from jaxspec.config import KimiConfig

# K2.5 is multimodal: vision tensors are skipped (vision is out of scope) and the text model's prefix is stripped.
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
TEXT_PREFIX = "language_model."


# safetensors dtype names per kind of tensor: float weights (FP8 ones are dequantised by the reader) and integers.
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
            outside = sorted({str(f) for f in self.files.values() if not f.resolve().is_relative_to(root)})
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

    def get(self, name: str) -> np.ndarray:
        return self._open(name).get_tensor(name)


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
Transform = Callable[[np.ndarray], np.ndarray]
T: Transform = lambda w: w.T  # noqa: E731
ident: Transform = lambda w: w  # noqa: E731


def _attn_table(cfg: KimiConfig) -> list[tuple[tuple[str, ...], str, tuple[int, ...], Transform]]:
    """(param path within a layer, HF suffix, expected HF shape, transform) for attention and norms."""
    D, Q, C = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
    N, H, R, A = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim

    def heads(rows: int, lo: int, hi: int) -> Transform:  # [N*rows, in] -> [in, N, hi-lo]
        return lambda w: w.reshape(N, rows, -1)[:, lo:hi].transpose(2, 0, 1)

    if cfg.q_lora:
        query = [
            (("attn", "q_a"), "self_attn.q_a_proj.weight", (Q, D), T),
            (("attn", "q_a_norm"), "self_attn.q_a_layernorm.weight", (Q,), ident),
            (("attn", "q_b_nope"), "self_attn.q_b_proj.weight", (N * (H + R), Q), heads(H + R, 0, H)),
            (("attn", "q_b_rope"), "self_attn.q_b_proj.weight", (N * (H + R), Q), heads(H + R, H, H + R)),
        ]
    else:
        query = [
            (("attn", "q_nope"), "self_attn.q_proj.weight", (N * (H + R), D), heads(H + R, 0, H)),
            (("attn", "q_rope"), "self_attn.q_proj.weight", (N * (H + R), D), heads(H + R, H, H + R)),
        ]
    return [
        (("input_norm",), "input_layernorm.weight", (D,), ident),
        (("post_attn_norm",), "post_attention_layernorm.weight", (D,), ident),
        *query,
        (("attn", "kv_a_latent"), "self_attn.kv_a_proj_with_mqa.weight", (C + R, D), lambda w: w[:C].T),
        (("attn", "kv_a_rope"), "self_attn.kv_a_proj_with_mqa.weight", (C + R, D), lambda w: w[C:].T),
        (("attn", "kv_a_norm"), "self_attn.kv_a_layernorm.weight", (C,), ident),
        (("attn", "kv_b_k"), "self_attn.kv_b_proj.weight", (N * (H + A), C), heads(H + A, 0, H)),
        (("attn", "kv_b_v"), "self_attn.kv_b_proj.weight", (N * (H + A), C), heads(H + A, H, H + A)),
        (
            ("attn", "o"),
            "self_attn.o_proj.weight",
            (D, N * A),
            lambda w: w.reshape(D, N, A).transpose(1, 2, 0),
        ),
    ]


def _mlp_table(prefix: str, hidden: int, inner: int, path: tuple[str, ...]):
    return [
        ((*path, "gate"), f"{prefix}.gate_proj.weight", (inner, hidden), T),
        ((*path, "up"), f"{prefix}.up_proj.weight", (inner, hidden), T),
        ((*path, "down"), f"{prefix}.down_proj.weight", (hidden, inner), T),
    ]


def _layer_table(cfg: KimiConfig, moe: bool):
    D, E, F = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    table = _attn_table(cfg)
    if not moe:
        return table + _mlp_table("mlp", D, cfg.intermediate_size, ("mlp",))
    return table + [
        (("mlp", "router"), "mlp.gate.weight", (E, D), T),
        (("mlp", "router_bias"), "mlp.gate.e_score_correction_bias", (E,), ident),
        *_mlp_table("mlp.shared_experts", D, F * cfg.n_shared_experts, ("mlp", "shared")),
    ]


def _expert_names(layer: int, e: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj"


# ----------------------------------------------------------------------------------------------- loading
class _Reader:
    """Reads tensors by text-model name, recording what was used and every problem."""

    def __init__(self, ckpt: SafetensorsDir):
        self.ckpt = ckpt
        self.names, self.skipped = text_names(ckpt)
        self.used: set[str] = set()
        self.problems: list[str] = []

    def get(self, name: str, shape: tuple[int, ...], kind: str = "float") -> np.ndarray | None:
        """The tensor, or None after recording why not; `kind` is "float" (weights, scales) or "int" (packed)."""
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
        return self.ckpt.get(self.names[name])


def read_params(path: str | Path, cfg: KimiConfig, *, int4_experts: bool, dtype: np.dtype) -> dict[str, Any]:
    """Read an HF checkpoint into a nested dict shaped like `nnx.state(KimiModel)` (numpy leaves).

    Non-expert weights are cast to `dtype`; INT4 experts stay 4-bit (`Int4Array`) with their stored scales.
    """
    from jaxspec.fp8 import open_checkpoint  # FP8 block weights arrive dequantised to `dtype`
    from jaxspec.models.quant import Int4Array

    dtype = np.dtype(dtype)
    reader = _Reader(open_checkpoint(path, dtype))
    cast = lambda a: None if a is None else np.asarray(a).astype(dtype)  # noqa: E731
    D, V = cfg.hidden_size, cfg.vocab_size
    params: dict[str, Any] = {
        "embed": cast(reader.get("model.embed_tokens.weight", (V, D))),
        "final_norm": cast(reader.get("model.norm.weight", (D,))),
    }
    head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    head = reader.get(head_name, (V, D))
    params["lm_head"] = None if head is None else cast(head.T)

    k = cfg.first_k_dense_replace
    for stack, layers, moe in (
        ("dense_layers", range(k), False),
        ("moe_layers", range(k, cfg.num_hidden_layers), True),
    ):
        if not layers:
            continue
        per_layer = [_read_layer(reader, cfg, i, moe, int4_experts, cast) for i in layers]
        params[stack] = _stack(per_layer, Int4Array)

    unexpected = sorted(n for n in set(reader.names) - reader.used if not _is_ignorable(n, cfg, reader.names))
    problems = reader.problems + [f"unexpected tensor {n}" for n in unexpected]
    if problems:
        raise CheckpointError(f"{path}: {len(problems)} problem(s) with the checkpoint:\n  " + "\n  ".join(problems))
    return params


# What a DeepSeek-V3 multi-token-prediction layer holds: a full decoder layer plus its own norms, projection, and
# (copies of) the embedding and head. FP8 checkpoints add a weight_scale_inv per matrix.
_MTP_SUFFIX = re.compile(
    r"(input_layernorm|post_attention_layernorm|enorm|hnorm|eh_proj|embed_tokens|shared_head\.(norm|head)"
    r"|self_attn\.(q_proj|q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj|o_proj)"
    r"|mlp\.(gate_proj|up_proj|down_proj|gate|shared_experts\.(gate|up|down)_proj|experts\.\d+\.(gate|up|down)_proj))"
    r"\.(weight|weight_scale_inv|e_score_correction_bias|weight_packed|weight_scale|weight_shape)"
)


def _is_ignorable(name: str, cfg: KimiConfig, names: Collection[str] | None = None) -> bool:
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


def _read_layer(reader: _Reader, cfg: KimiConfig, layer: int, moe: bool, int4: bool, cast) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cache: dict[str, np.ndarray | None] = {}
    for path, suffix, shape, transform in _layer_table(cfg, moe):
        name = f"model.layers.{layer}.{suffix}"
        if name not in cache:
            cache[name] = reader.get(name, shape)
        w = cache[name]
        _set(out, path, None if w is None else cast(transform(w)))
    if moe:
        for proj in ("gate", "up", "down"):
            _set(out, ("mlp", proj), _read_experts(reader, cfg, layer, proj, int4, cast))
    return out


def _read_experts(reader: _Reader, cfg: KimiConfig, layer: int, proj: str, int4: bool, cast):
    """Stack one projection of all experts to our [E, in, out] layout (INT4 stays INT4)."""
    from jaxspec.models.quant import Int4Array

    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    out_f, in_f = (D, F) if proj == "down" else (F, D)
    mats, scales = [], []
    for e in range(cfg.n_routed_experts):
        base = _expert_names(layer, e, proj)
        if not int4:
            w = reader.get(f"{base}.weight", (out_f, in_f))
            mats.append(None if w is None else w.T)
            continue
        g = cfg.quant.group_size
        packed = reader.get(f"{base}.weight_packed", (out_f, in_f // 8), "int")
        scale = reader.get(f"{base}.weight_scale", (out_f, in_f // g))
        shape = reader.get(f"{base}.weight_shape", (2,), "int")
        if shape is not None and tuple(int(s) for s in shape) != (out_f, in_f):
            reader.problems.append(f"{base}.weight_shape: expected [{out_f}, {in_f}], got {shape.tolist()}")
        if packed is None or scale is None:
            mats.append(None)
            continue
        mats.append(unpack_int4(packed, in_f).T)
        scales.append(scale.T)
    if any(m is None for m in mats):
        return None
    if not int4:
        return cast(np.stack(mats))
    # Scales keep their stored dtype: a weight is bf16(q * scale) whatever the compute dtype (see quant.py).
    return Int4Array.from_values(np.stack(mats), np.stack(scales), cfg.quant.group_size)


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _leaves(tree: dict, prefix=()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, (*prefix, k))
        else:
            yield (*prefix, k), v


def _stack(per_layer: list[dict], int4_type) -> dict | None:
    """Stack per-layer dicts on a new leading axis; None if any layer had a problem (already reported)."""
    out: dict = {}
    for path, first in _leaves(per_layer[0]):
        vals = []
        for layer in per_layer:
            v = layer
            for p in path:
                v = v[p]
            vals.append(v)
        if any(v is None for v in vals):
            _set(out, path, None)
        elif isinstance(first, int4_type):
            _set(
                out,
                path,
                int4_type(np.stack([v.packed for v in vals]), np.stack([v.scale for v in vals]), first.group_size),
            )
        else:
            _set(out, path, np.stack(vals))
    return out
