"""On-disk layout of a converted target, and restoring it straight into a mesh's shardings.

    OUT/config.json               copied from the HF directory (plus tokenizer and other small files)
    OUT/jaxspec_convert.json      the plan: written FIRST (source, dtype, groups); a rerun must match it
    OUT/params/top/               Orbax checkpoint: embed, final_norm, lm_head
    OUT/params/layer_00000/ ...   one Orbax checkpoint per decoder layer (the layer's slice of every stacked param)
    OUT/params/<group>.done       written once that group's save has finished (a rerun skips it)
    OUT/jaxspec_checkpoint.json   the completion marker: written LAST, after every group is finalized

Int4Array leaves are stored as their two arrays {"packed": uint8, "scale": bf16}. Restoring reads each group with
`ShapeDtypeStruct`s that carry the per-layer slice of the target sharding (so each process reads only its slices)
and writes it into the stacked, already-sharded array in place (donated), so device memory peaks at the model plus
one layer.
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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.config import KimiConfig
from jaxspec.hf import CheckpointError
from jaxspec.models.quant import Int4Array
from jaxspec.target import Target
from sharding.rules import DEFAULT_RULES, ShardingRules

FORMAT = "jaxspec-orbax"
VERSION = 1
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


def flatten_int4(tree: Any) -> Any:
    """Replace every Int4Array in a nested dict by {"packed", "scale"} (what Orbax stores)."""
    if isinstance(tree, Int4Array):
        return {"packed": tree.packed, "scale": tree.scale}
    if isinstance(tree, dict):
        return {k: flatten_int4(v) for k, v in tree.items()}
    return tree


def read_marker(root: str | Path) -> dict[str, Any] | None:
    """The completion marker's contents; None if `root` is not a conversion output at all.

    Raises CheckpointError for a conversion that was started but never completed.
    """
    root = Path(root)
    if (root / MARKER).is_file():
        marker = json.loads((root / MARKER).read_text())
        if marker.get("format") != FORMAT or marker.get("version") != VERSION:
            raise CheckpointError(
                f"{root / MARKER}: unsupported checkpoint format {marker.get('format')!r} version "
                f"{marker.get('version')!r} (expected {FORMAT!r} version {VERSION})"
            )
        return marker
    if (root / PLAN).is_file() or (root / "params").is_dir():
        raise CheckpointError(
            f"{root}: incomplete jaxspec conversion (no {MARKER}); rerun `jaxspec-convert target` with the same "
            "--src and --dst to finish it"
        )
    return None


def maybe_restore(
    path: str | Path, *, mesh: Mesh, dtype=jnp.bfloat16, rules: ShardingRules = DEFAULT_RULES
) -> Target | None:
    """Restore a converted target onto `mesh`; None if `path` is not a conversion output (an HF directory)."""
    marker = read_marker(path)
    if marker is None:
        return None
    return restore_target(path, mesh=mesh, dtype=dtype, rules=rules)


def restore_target(path: str | Path, *, mesh: Mesh, dtype=jnp.bfloat16, rules: ShardingRules = DEFAULT_RULES) -> Target:
    """Restore a complete conversion output into `Target.abstract(cfg, mesh=mesh, dtype=dtype)`'s shardings."""
    path = Path(path)
    cfg = KimiConfig.from_pretrained(path)
    missing = [g for g in group_names(cfg) if not is_group_complete(path, g)]
    if missing:
        raise CheckpointError(f"{path}: marked complete but groups are missing or unfinalized: {missing}")
    abstract = Target.abstract(cfg, mesh=mesh, dtype=dtype, int4_experts=cfg.quant is not None, rules=rules)
    flat = [(p, v.get_value()) for p, v in nnx.to_flat_state(abstract.params)]
    ck = ocp.StandardCheckpointer()
    values: dict[tuple, Any] = {}

    top = {p[0]: flatten_int4(v) for p, v in flat if p[0] not in STACKS}
    for k, v in ck.restore(group_dir(path, "top"), top).items():
        values[(k,)] = v

    for stack in STACKS:
        leaves = {p[1:]: v for p, v in flat if p[0] == stack}
        if not leaves:
            continue
        abstract_stack = {p: flatten_int4(v) for p, v in leaves.items()}
        stacked = _zeros(abstract_stack)  # one program per stack, not per parameter
        per_layer = {p: jax.tree.map(_layer_slice, v) for p, v in abstract_stack.items()}
        for layer in (i for i in range(cfg.num_hidden_layers) if stack_of(cfg, i)[0] == stack):
            restored = ck.restore(group_dir(path, layer_group(layer)), _nest(per_layer))
            got = {p: _get(restored, p) for p in leaves}
            stacked = _put(stacked, got, jnp.int32(stack_of(cfg, layer)[1]))  # in place (donated)
            del restored, got
        for p, v in leaves.items():
            s = stacked[p]
            values[(stack, *p)] = Int4Array(s["packed"], s["scale"], v.group_size) if isinstance(v, Int4Array) else s

    params = nnx.from_flat_state([(p, var.replace(values[p])) for p, var in nnx.to_flat_state(abstract.params)])
    return Target(cfg, mesh, abstract.graphdef, params, rules)


def _zeros(abstract: Any) -> Any:
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    return jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract), out_shardings=shardings)()


def _layer_slice(sds: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """One layer of a stacked parameter: drop the leading axis from shape and sharding."""
    spec = tuple(sds.sharding.spec) + (None,) * (len(sds.shape) - len(sds.sharding.spec))
    return jax.ShapeDtypeStruct(sds.shape[1:], sds.dtype, sharding=NamedSharding(sds.sharding.mesh, P(*spec[1:])))


@functools.partial(jax.jit, donate_argnums=0)
def _put(stacked: Any, layer: Any, index: jax.Array) -> Any:
    """Write one layer into every stacked parameter at `index` (leading axis)."""
    put = lambda s, x: jax.lax.dynamic_update_index_in_dim(s, x.astype(s.dtype), index, 0)  # noqa: E731
    return jax.tree.map(put, stacked, layer)


def _nest(flat: dict[tuple, Any]) -> dict:
    out: dict = {}
    for p, v in flat.items():
        d = out
        for k in p[:-1]:
            d = d.setdefault(k, {})
        d[p[-1]] = v
    return out


def _get(tree: dict, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree
