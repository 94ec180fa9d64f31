"""The target against HF transformers' DeepseekV3ForCausalLM (PyTorch CPU), loaded from the same safetensors."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxspec import KimiConfig, Target, load_target

TOKENS = np.random.default_rng(0).integers(0, 256, (2, 24))


def rel_err(ours, ref) -> float:
    return float(np.abs(np.asarray(ours, np.float64) - ref).max() / ref.std())


def hf_forward(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens), output_hidden_states=True)


@pytest.mark.parametrize("kind", ["kimi", "dsv3"])
def test_fp32_logits_and_hidden_states_match_hf(hf_checkpoint, kind):
    path, model = hf_checkpoint(kind)
    ref = hf_forward(model, TOKENS)
    target = load_target(path, dtype=jnp.float32)
    assert rel_err(target.logits(TOKENS), ref.logits.numpy()) <= 1e-4
    L = target.config.num_hidden_layers
    # HF hidden_states[k+1] is the output of layer k, except the last entry, which has the final norm applied.
    layers = list(range(L - 1))
    for k, ours in zip(layers, target.hidden_states(TOKENS, layers), strict=True):
        assert rel_err(ours, ref.hidden_states[k + 1].numpy()) <= 1e-4, f"layer {k}"


def _routing(model, tokens):
    """Top-k expert sets per MoE layer chosen by the HF router (forward hooks)."""
    picks = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: picks.append(out[2].sort(-1).values))
        for m in model.modules()
        if type(m).__name__ == "DeepseekV3TopkRouter"
    ]
    with torch.no_grad():
        model(torch.as_tensor(tokens))
    for h in hooks:
        h.remove()
    return picks


@pytest.mark.parametrize("kind", ["kimi", "dsv3"])
def test_bf16_error_is_no_worse_than_hf_bf16(hf_checkpoint, kind, record_property):
    """bf16 cannot match fp32 exactly, and routing near-ties can flip. The tolerance is measured, not guessed:
    our bf16 logits may differ from the fp32 reference by at most 1.5x what HF's own bf16 model does (+0.01 std)."""
    path, model = hf_checkpoint(kind)
    ref = hf_forward(model, TOKENS).logits.numpy()
    hf_bf16 = model.to(torch.bfloat16)
    try:
        hf_err = rel_err(hf_forward(hf_bf16, TOKENS).logits.float().numpy(), ref)
        flips = sum(
            int((a != b).any(-1).sum())
            for a, b in zip(_routing(model, TOKENS), _routing(model.float(), TOKENS), strict=True)
        )
    finally:
        model.float()
    ours = rel_err(load_target(path, dtype=jnp.bfloat16).logits(TOKENS).astype(jnp.float32), ref)
    record_property("bf16_rel_err", ours)
    record_property("hf_bf16_rel_err", hf_err)
    record_property("routing_flips_hf_bf16_vs_fp32", flips)
    print(f"[{kind}] bf16 rel err: jaxspec {ours:.4f}, HF {hf_err:.4f}; HF routing flips bf16 vs fp32: {flips}")
    assert ours <= 1.5 * hf_err + 0.01


def _primitives(jaxpr) -> collections.Counter:
    """Primitive names in `jaxpr` and every jaxpr nested in it (jit wrappers themselves not counted)."""
    counts = collections.Counter()
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += eqn.primitive.name != "jit"
        for v in eqn.params.values():
            if hasattr(v, "eqns") or hasattr(v, "jaxpr"):
                counts += _primitives(getattr(v, "jaxpr", v))
    return +counts


def _scan_bodies(jaxpr) -> list[collections.Counter]:
    """`_primitives` of each outermost `scan` body in `jaxpr` and the jaxprs nested in it."""
    bodies = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            bodies.append(_primitives(eqn.params["jaxpr"].jaxpr))
            continue
        for v in eqn.params.values():
            if hasattr(v, "eqns") or hasattr(v, "jaxpr"):
                bodies += _scan_bodies(getattr(v, "jaxpr", v))
    return bodies


def test_capture_costs_each_layer_one_write():
    """A captured forward's layer scans run what an uncaptured one runs plus one in-place write per layer: no work
    on the layer id to find its slot (that was the K=0 tax of adaptive serving: docs/serving.md)."""
    target = Target.random(KimiConfig.preset("tiny"), dtype=jnp.float32, seed=1)
    cache = target.init_cache(2, 32)
    tokens, pos = jnp.zeros((2, 1), jnp.int32), jnp.full((2, 1), 3, jnp.int32)
    L = target.config.num_hidden_layers
    trace = lambda capture: jax.make_jaxpr(
        lambda p, c: target.apply(p, tokens, pos, c, capture=capture, head="argmax")
    )(target.params, cache)
    plain, captured = _scan_bodies(trace(()).jaxpr), _scan_bodies(trace((0, L - 1)).jaxpr)
    carry, x = jnp.zeros((3, 2, 1, target.config.hidden_size)), jnp.zeros((2, 1, target.config.hidden_size))
    one_write = jax.make_jaxpr(lambda c, i: jax.lax.dynamic_update_index_in_dim(c, x, i, 0))(carry, jnp.int32(1))
    write = _primitives(one_write.jaxpr)
    assert len(plain) == len(captured) >= 2  # one scan per stack (dense, MoE), as the capture's slots assume
    for a, b in zip(plain, captured, strict=True):
        extra = b - a
        del extra["pvary"]  # shard_map's varying-axis annotations: nothing runs
        assert extra == write, extra
