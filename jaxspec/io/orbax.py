"""On-disk layout of a converted target, and restoring it straight into a mesh's shardings.

    OUT/config.json               copied from the HF directory (plus tokenizer and other small files)
    OUT/jaxspec_convert.json      the plan: written FIRST (source, dtype, groups); a rerun must match it
    OUT/params/top/               Orbax checkpoint: embed, final_norm, lm_head
    OUT/params/layer_00000/ ...   one Orbax checkpoint per decoder layer (the layer's slice of every stacked param)
    OUT/params/<group>.done       written once that group's save has finished (a rerun skips it)
    OUT/jaxspec_checkpoint.json   the completion marker: written LAST, after every group is finalized

Int4Array leaves are stored as their two arrays {"packed": uint8, "scale": bf16}, Fp8Array leaves as theirs
{"values": float8_e4m3fn, "scale": float32}. Float and FP8 routed experts (version 2) are stored as the HF checkpoint
holds them, [E, out, in] per layer (FP8: the checkpoint's bytes and `weight_scale_inv` blocks unchanged), so the
converter reads each expert straight into place (a host-side transpose to our [E, in, out] cost more CPU per byte
than the write); restore swaps the two axes on device. Version 1 outputs ([E, in, out]) still load. Groups are zarr3
arrays without OCDBT (less CPU per byte to write); Orbax reads either kind. `restore_params` reads each group with
`ShapeDtypeStruct`s that carry the per-layer slice of the target sharding (so each process reads only its slices) and
writes it into the stacked, already-sharded array in place (donated), so device memory peaks at the model plus one
layer.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxspec.config import KimiConfig
from jaxspec.io.hf import CheckpointError
from jaxspec.models.moe import ROUTED_PATHS
from jaxspec.models.quant import Fp8Array, Int4Array
from jaxspec.pytree import get_path, unflatten

FORMAT = "jaxspec-orbax"
VERSION = 2
READABLE_VERSIONS = (1, 2)
PLAN = "jaxspec_convert.json"
MARKER = "jaxspec_checkpoint.json"
STACKS = ("dense_layers", "moe_layers")


def group_names(cfg: KimiConfig) -> list[str]:
    """Orbax group directory names under params/, in write order."""
    return ["top"] + [layer_group(i) for i in range(cfg.num_hidden_layers)]


def layer_group(layer: int) -> str:
    return f"layer_{layer:05d}"


def stack_of(cfg: KimiConfig, layer: int) -> tuple[str, int]:
    """(stack name, index within the stack) of a global layer index."""
    k = cfg.first_k_dense_replace
    return ("dense_layers", layer) if layer < k else ("moe_layers", layer - k)


def group_dir(root: str | Path, name: str) -> Path:
    return Path(root) / "params" / name


def done_file(root: str | Path, name: str) -> Path:
    """Written after Orbax has finished (and finalized) a group: our own record, whatever Orbax's atomicity mode."""
    return Path(root) / "params" / f"{name}.done"


def is_group_complete(root: str | Path, name: str) -> bool:
    d = group_dir(root, name)
    return done_file(root, name).is_file() and d.is_dir() and ocp.utils.is_checkpoint_finalized(d)


def flatten_quant(tree: Any) -> Any:
    """Replace every Int4Array in a nested dict by {"packed", "scale"} and every Fp8Array by {"values", "scale"}
    (what Orbax stores)."""
    if isinstance(tree, Int4Array):
        return {"packed": tree.packed, "scale": tree.scale}
    if isinstance(tree, Fp8Array):
        return {"values": tree.values, "scale": tree.scale}
    if isinstance(tree, dict):
        return {k: flatten_quant(v) for k, v in tree.items()}
    return tree


def read_marker(root: str | Path) -> dict[str, Any] | None:
    """The completion marker's contents; None if `root` is not a conversion output at all.

    Raises CheckpointError for a conversion that was started but never completed.
    """
    root = Path(root)
    if (root / MARKER).is_file():
        marker = json.loads((root / MARKER).read_text())
        if marker.get("format") != FORMAT or marker.get("version") not in READABLE_VERSIONS:
            raise CheckpointError(
                f"{root / MARKER}: unsupported checkpoint format {marker.get('format')!r} version "
                f"{marker.get('version')!r} (expected {FORMAT!r} version {' or '.join(map(str, READABLE_VERSIONS))})"
            )
        return marker
    if (root / PLAN).is_file() or (root / "params").is_dir():
        raise CheckpointError(
            f"{root}: incomplete jaxspec conversion (no {MARKER}); rerun `jaxspec-convert target` with the same "
            "--src and --dst to finish it"
        )
    return None


def check_complete(path: str | Path, cfg: KimiConfig) -> None:
    """Raise CheckpointError unless every group of a conversion marked complete is there and finalized."""
    missing = [g for g in group_names(cfg) if not is_group_complete(path, g)]
    if missing:
        raise CheckpointError(f"{path}: marked complete but groups are missing or unfinalized: {missing}")


def restore_params(path: str | Path, cfg: KimiConfig, abstract: Any) -> Any:
    """The parameters of a complete conversion output, restored into `abstract`'s shardings.

    `abstract` is the nnx.State of ShapeDtypeStructs with shardings that `Target.abstract` builds; the result is the
    same State holding arrays. Decoder layers are written one at a time into their stacked, sharded arrays.
    """
    path = Path(path)
    check_complete(path, cfg)
    as_stored = read_marker(path)["version"] >= 2  # float routed experts stored [E, out, in]
    flat = [(p, v.get_value()) for p, v in nnx.to_flat_state(abstract)]
    ck = ocp.StandardCheckpointer()
    top = {p[0]: flatten_quant(v) for p, v in flat if p[0] not in STACKS}
    values: dict[tuple, Any] = {(k,): v for k, v in ck.restore(group_dir(path, "top"), top).items()}
    for stack in STACKS:
        leaves = {p[1:]: v for p, v in flat if p[0] == stack}
        if leaves:
            routed = as_stored and stack == "moe_layers"  # a dense layer's ("mlp", "gate") is its own MLP
            floats = [p for p in ROUTED_PATHS if p in leaves and not isinstance(leaves[p], Int4Array)]  # and FP8
            swapped = frozenset(floats if routed else ())
            restored = _restore_stack(ck, path, cfg, stack, leaves, swapped)
            values.update({(stack, *p): v for p, v in restored.items()})
    return nnx.from_flat_state([(p, var.replace(values[p])) for p, var in nnx.to_flat_state(abstract)])


def _restore_stack(
    ck: ocp.StandardCheckpointer, path: Path, cfg: KimiConfig, stack: str, leaves: dict, swapped: frozenset
) -> dict:
    """{path within the stack: stacked array (Int4Array for INT4 leaves)}, one layer group read at a time; the
    leaves in `swapped` are stored with their last two axes swapped."""
    abstract_stack = {p: flatten_quant(v) for p, v in leaves.items()}
    stacked = _zeros(abstract_stack)  # one program per stack, not per parameter
    per_layer = {p: jax.tree.map(_layer_slice, v) for p, v in abstract_stack.items()}
    per_layer |= {p: jax.tree.map(_swap_last, per_layer[p]) for p in swapped}
    for layer in (i for i in range(cfg.num_hidden_layers) if stack_of(cfg, i)[0] == stack):
        restored = ck.restore(group_dir(path, layer_group(layer)), unflatten(per_layer))
        got = {p: get_path(restored, p) for p in leaves}
        stacked = _put(stacked, got, jnp.int32(stack_of(cfg, layer)[1]), swapped)  # in place (donated)
        del restored, got
    out = {}
    for p, v in leaves.items():
        s = stacked[p]
        if isinstance(v, Int4Array):
            s = Int4Array(s["packed"], s["scale"], v.group_size)
        elif isinstance(v, Fp8Array):
            s = Fp8Array(s["values"], s["scale"], v.blocks)
        out[p] = s
    return out


def _zeros(abstract: Any) -> Any:
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    return jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract), out_shardings=shardings)()


def _layer_slice(sds: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """One layer of a stacked parameter: drop the leading axis from shape and sharding."""
    spec = tuple(sds.sharding.spec) + (None,) * (len(sds.shape) - len(sds.sharding.spec))
    return jax.ShapeDtypeStruct(
        sds.shape[1:], sds.dtype, sharding=NamedSharding(sds.sharding.mesh, PartitionSpec(*spec[1:]))
    )


def _swap_last(sds: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """The same array with its last two axes (and their sharding) swapped: how a float expert stack is stored."""
    spec = tuple(sds.sharding.spec) + (None,) * (len(sds.shape) - len(sds.sharding.spec))
    shape, spec = (*sds.shape[:-2], sds.shape[-1], sds.shape[-2]), (*spec[:-2], spec[-1], spec[-2])
    return jax.ShapeDtypeStruct(shape, sds.dtype, sharding=NamedSharding(sds.sharding.mesh, PartitionSpec(*spec)))


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _put(stacked: Any, layer: Any, index: jax.Array, swapped: frozenset) -> Any:
    """Write one layer into every stacked parameter at `index` (leading axis), swapping the last two axes of the
    leaves in `swapped` first (a local transpose: their shardings were swapped too)."""
    put = lambda s, x: jax.lax.dynamic_update_index_in_dim(s, x.astype(s.dtype), index, 0)
    layer = {p: jax.tree.map(lambda a: jnp.swapaxes(a, -1, -2), x) if p in swapped else x for p, x in layer.items()}
    return jax.tree.map(put, stacked, layer)
