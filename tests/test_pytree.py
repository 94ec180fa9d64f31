"""jaxspec.pytree: the nested-dict helpers every checkpoint reader and writer walks parameter trees with."""

import numpy as np
import pytest

from jaxspec.pytree import flatten, get_path, set_path, unflatten


def test_flatten_unflatten_round_trip_keeps_order_and_leaves():
    tree = {"embed": np.ones(2), "layers": {"attn": {"q": 1, "k": None}, "mlp": {"up": "x"}}, "norm": 2.0}
    flat = list(flatten(tree))
    assert [p for p, _ in flat] == [
        ("embed",),
        ("layers", "attn", "q"),
        ("layers", "attn", "k"),
        ("layers", "mlp", "up"),
        ("norm",),
    ]
    assert flat[2][1] is None  # a None leaf (a tensor that failed to read) is a leaf, not dropped
    back = unflatten(flat)
    assert back.keys() == tree.keys() and back["layers"] == tree["layers"]
    assert unflatten(dict(flat))["layers"]["mlp"]["up"] == "x"


def test_get_and_set_path():
    tree: dict = {}
    set_path(tree, ("a", "b", "c"), 3)
    set_path(tree, ("a", "d"), 4)
    assert tree == {"a": {"b": {"c": 3}, "d": 4}}
    assert get_path(tree, ("a", "b", "c")) == 3 and get_path(tree, ()) is tree
    with pytest.raises(KeyError):
        get_path(tree, ("a", "x"))
