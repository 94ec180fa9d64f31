"""The real Kimi-K2.5 configuration builds abstractly (nothing allocated) with INT4 routed experts."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import KimiConfig, Target
from jaxspec.models.quant import Int4Array


def test_kimi_k25_abstract_parameter_count_and_int4_experts():
    target = Target.abstract(KimiConfig.preset("kimi-k2.5"))
    n_params = 0
    for _, var in __import__("flax").nnx.to_flat_state(target.params):
        value = var.get_value()
        # A quantised weight counts its 4-bit values as parameters; group scales are quantisation metadata.
        n_params += int(np.prod(value.shape))
    assert abs(n_params - 1.026e12) / 1.026e12 < 0.005, n_params
    experts = target.params["moe_layers"]["mlp"]
    for proj, shape in (
        ("gate", (60, 384, 7168, 2048)),
        ("up", (60, 384, 7168, 2048)),
        ("down", (60, 384, 2048, 7168)),
    ):
        w = experts[proj].get_value()
        assert isinstance(w, Int4Array) and w.packed.dtype == jnp.uint8 and w.shape == shape
        assert w.packed.shape == shape[:-2] + (shape[-2] // 2, shape[-1])  # 4 bits per value
        assert w.scale.shape == shape[:-2] + (shape[-2] // 32, shape[-1])
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(target.params))
