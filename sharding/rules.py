"""The one table from logical axis names (jaxspec/glossary.md) to mesh axes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jax.sharding import Mesh, PartitionSpec

from sharding.mesh import DATA, MODEL


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (None = replicated). Field names are the logical axes.

    Decode/verify-first plan: attention heads, experts, the MLP hidden dim and the vocabulary are split over
    `model` (tensor/expert parallel); the batch over `data`; everything else is replicated.
    """

    batch: str | None = DATA
    vocab: str | None = MODEL
    heads: str | None = MODEL
    experts: str | None = MODEL
    mlp: str | None = MODEL
    embed: str | None = None
    q_lora: str | None = None
    kv_lora: str | None = None
    layers: str | None = None

    @property
    def model_axis(self) -> str:
        """The mesh axis of tensor/expert parallelism: the one axis that vocab, heads, experts and mlp are split over,
        and the axis the model code reduces over (psum, axis_index) inside shard_map."""
        axes = {a for a in (self.vocab, self.heads, self.experts, self.mlp) if a is not None}
        if len(axes) != 1:
            raise ValueError(
                "sharding rules: vocab, heads, experts and mlp must map to one mesh axis (or None), and at least one "
                f"to an axis (the model code reduces over it); got {sorted(axes)}"
            )
        return axes.pop()

    def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
        """PartitionSpec for an array with these logical axes; refuses a mesh axis used twice."""
        mesh_axes = []
        for name in logical_axes:
            if name is None:
                mesh_axes.append(None)
                continue
            if not hasattr(self, name):
                raise KeyError(f"unknown logical axis {name!r}; known: {[f.name for f in dataclasses.fields(self)]}")
            mesh_axes.append(getattr(self, name))
        used = [a for a in mesh_axes if a is not None]
        if len(used) != len(set(used)):
            raise ValueError(f"logical axes {tuple(logical_axes)} map mesh axis twice: {tuple(mesh_axes)}")
        return PartitionSpec(*mesh_axes)


DEFAULT_RULES = ShardingRules()


def check_divisible(mesh: Mesh, sizes: Mapping[str, int], rules: ShardingRules = DEFAULT_RULES) -> None:
    """Every logical dimension split over a mesh axis must divide evenly; the error names the dimension."""
    problems = []
    for logical, size in sizes.items():
        axis = getattr(rules, logical)
        if axis is not None and size % mesh.shape[axis]:
            problems.append(f"{logical}={size} is not divisible by mesh axis {axis!r} of size {mesh.shape[axis]}")
    if problems:
        raise ValueError("mesh does not fit the model: " + "; ".join(problems))
