"""`alternating_seconds`: one round of an in-process A/B, its order reversed every other round."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxspec.profiling.timing import alternating_seconds


def test_each_function_runs_its_calls_in_an_order_that_alternates_by_round():
    calls = []
    fns = {name: (lambda x, name=name: calls.append(name) or jnp.asarray(x)) for name in ("a", "b", "c")}
    for r, order in ((0, "abc"), (1, "cba"), (2, "abc")):
        calls.clear()
        seconds = alternating_seconds(fns, (1.0,), calls=3, round_index=r)
        assert "".join(calls) == "".join(n * 3 for n in order)
        assert list(seconds) == ["a", "b", "c"] and all(s >= 0 for s in seconds.values())
    with pytest.raises(ValueError, match="calls: expected >= 1"):
        alternating_seconds(fns, (1.0,), calls=0, round_index=0)
