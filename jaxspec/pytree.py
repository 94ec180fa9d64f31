"""Nested parameter dicts ({"attn": {"q_a": array, ...}, ...}) addressed by key paths such as ("attn", "q_a").

Checkpoint readers and writers build and walk these trees (the shape of `nnx.state(model)` as plain dicts);
a leaf is anything that is not a dict (arrays, `Int4Array`s, None for a tensor that failed to read).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import Any

Path = tuple[Hashable, ...]


def flatten(tree: Mapping, prefix: Path = ()) -> Iterator[tuple[Path, Any]]:
    """(path, leaf) for every leaf of a nested dict, depth first in insertion order."""
    for k, v in tree.items():
        if isinstance(v, Mapping):
            yield from flatten(v, (*prefix, k))
        else:
            yield (*prefix, k), v


def unflatten(flat: Iterable[tuple[Path, Any]] | Mapping[Path, Any]) -> dict:
    """The nested dict holding each value at its path (the inverse of `flatten`)."""
    out: dict = {}
    for path, value in flat.items() if isinstance(flat, Mapping) else flat:
        set_path(out, path, value)
    return out


def get_path(tree: Any, path: Iterable[Hashable]) -> Any:
    """tree[p0][p1]...; works on anything indexable by key (dicts, nnx.State)."""
    for k in path:
        tree = tree[k]
    return tree


def set_path(tree: dict, path: Path, value: Any) -> None:
    """Set tree[p0][p1]... = value, creating the intermediate dicts."""
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value
