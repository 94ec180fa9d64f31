"""HLO census, memory report and parameter bytes, checked on real compiled 8-device programs."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.inspect import (
    collective_census,
    device_param_bytes,
    format_report,
    memory_report,
    param_bytes,
    parse_hlo_shape,
    per_device_param_bytes,
    shape_bytes,
)
from tests.sharding.hlo_checks import all_gathers, find_weight_all_gathers, while_loops


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))


def _sds(mesh, shape, spec, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


SPLIT = P("model")


def _smap(mesh, f, in_specs=SPLIT, out_specs=SPLIT, check_vma=True):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))


def _counts(census) -> dict[str, tuple[int, int]]:
    return {k: (v["static"], v["executed"]) for k, v in census.items() if v["static"]}


# ---------------------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    ("shape", "nbytes"),
    [
        ("f32[8,128]{1,0}", 8 * 128 * 4),
        ("bf16[4,16]{1,0:T(8,128)(2,1)S(1)}", 4 * 16 * 2),
        ("(f32[2]{0}, bf16[4,4]{1,0})", 2 * 4 + 16 * 2),
        ("(f32[1,16]{1,0}, /*index=1*/f32[1,16]{1,0})", 2 * 64),
        ("s4[3,5]{1,0:E(4)}", 8),  # 15 nibbles -> 8 bytes
        ("u4[4]", 2),
        ("pred[]", 1),
        ("s32[]", 4),
        ("f8e4m3fn[10]", 10),
        ("f32[<=8,3]", 96),
        ("token[]", 0),
        ("((s32[], f32[2]), u8[3])", 4 + 8 + 3),
    ],
)
def test_shape_bytes(shape: str, nbytes: int) -> None:
    assert shape_bytes(shape) == nbytes


def test_parse_shape_and_unknown_dtype() -> None:
    assert parse_hlo_shape("(s32[], bf16[4,16]{1,0})") == [("s32", ()), ("bf16", (4, 16))]
    with pytest.raises(ValueError, match="unknown HLO element type 'q7'"):
        shape_bytes("q7[3]")


# ---------------------------------------------------------------------------------------------- census


def test_psum_chain_has_exactly_three_all_reduces(mesh) -> None:
    def f(x):
        a = jax.lax.psum(x, "model")
        b = jax.lax.psum(x * a, "model")  # depends on a: cannot be combined with it
        c = jax.lax.psum(x * b, "model")
        return x * c

    compiled = _smap(mesh, f).lower(_sds(mesh, (64, 16), P("model"))).compile()
    census = collective_census(compiled)
    assert _counts(census) == {"all-reduce": (3, 3)}
    assert census["all-reduce"]["static_bytes"] == 3 * 8 * 16 * 4  # per-device [8,16] f32 each
    assert census["all-reduce"]["executed_exact"]
    assert collective_census(compiled.as_text()) == census  # text and Compiled give the same answer


def test_scan_psum_counts_trip_count(mesh) -> None:
    def f(x):
        def body(c, _):
            return 0.5 * c + jax.lax.psum(jnp.sin(c), "model"), None

        return jax.lax.scan(body, x, None, length=5)[0]

    compiled = _smap(mesh, f).lower(_sds(mesh, (64, 16), P("model"))).compile()
    ar = collective_census(compiled)["all-reduce"]
    assert (ar["static"], ar["executed"], ar["executed_exact"]) == (1, 5, True)
    assert ar["executed_bytes"] == 5 * ar["static_bytes"] == 5 * 512
    assert [loop["trip_count"] for loop in while_loops(compiled)] == [5]


def test_nested_scans_multiply(mesh) -> None:
    def f(x):
        def inner(c, _):
            return 0.5 * c + jax.lax.psum(jnp.sin(c), "model"), None

        def outer(c, _):
            return jax.lax.scan(inner, c, None, length=3)[0], None

        return jax.lax.scan(outer, x, None, length=4)[0]

    compiled = _smap(mesh, f).lower(_sds(mesh, (64, 16), P("model"))).compile()
    assert _counts(collective_census(compiled)) == {"all-reduce": (1, 12)}
    assert sorted(loop["trip_count"] for loop in while_loops(compiled)) == [3, 4]


def test_data_dependent_while_is_marked_inexact(mesh) -> None:
    def f(x):
        def body(s):
            return 0.5 * s[0] + jax.lax.psum(jnp.sin(s[0]), "model"), s[1] + 1.0

        return jax.lax.while_loop(lambda s: s[1] < x[0, 0], body, (x, jnp.float32(0)))[0]

    compiled = _smap(mesh, f).lower(_sds(mesh, (64, 16), P("model"))).compile()
    ar = collective_census(compiled)["all-reduce"]
    assert (ar["static"], ar["executed"], ar["executed_exact"]) == (1, 1, False)
    assert [loop["trip_count"] for loop in while_loops(compiled)] == [None]


def test_other_collective_kinds(mesh) -> None:
    def f(x):
        a2a = jax.lax.all_to_all(x, "model", 0, 0, tiled=True)
        perm = jax.lax.ppermute(x, "model", [(i, (i + 1) % 8) for i in range(8)])
        rs = jax.lax.psum_scatter(x, "model", scatter_dimension=1, tiled=True)
        return a2a, perm, rs

    compiled = (
        _smap(mesh, f, out_specs=(P("model"), P("model"), P(None, "model")))
        .lower(_sds(mesh, (64, 16), P("model")))
        .compile()
    )
    census = collective_census(compiled)
    assert _counts(census) == {"all-to-all": (1, 1), "collective-permute": (1, 1), "reduce-scatter": (1, 1)}
    assert census["all-to-all"]["static_bytes"] == 8 * 16 * 4
    assert census["collective-permute"]["static_bytes"] == 8 * 16 * 4
    assert census["reduce-scatter"]["static_bytes"] == 8 * 2 * 4


def test_gspmd_inserted_all_reduce_is_counted() -> None:
    auto = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    a = jax.ShapeDtypeStruct((4, 64), jnp.float32, sharding=NamedSharding(auto, P(None, "model")))
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(auto, P("model", None)))
    step = jax.jit(lambda a, w: a @ w, out_shardings=NamedSharding(auto, P()))
    census = collective_census(step.lower(a, w).compile())
    assert _counts(census) == {"all-reduce": (1, 1)}
    assert census["all-reduce"]["static_bytes"] == 4 * 32 * 4


_ASYNC_HLO = """
HloModule synthetic, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped_rs (p: f32[64]) -> f32[8] {
  %p = f32[64]{0} parameter(0)
  ROOT %rs = f32[8]{0} reduce-scatter(%p), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}

%body (t: (s32[], f32[64])) -> (s32[], f32[64]) {
  %t = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[64]{0} get-tuple-element(%t), index=1
  %ars = f32[64]{0} all-reduce-start(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %ard = f32[64]{0} all-reduce-done(%ars)
  ROOT %r = (s32[], f32[64]{0}) tuple(%i, %ard)
}

%cond (t.1: (s32[], f32[64])) -> pred[] {
  %t.1 = (s32[], f32[64]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%t.1), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (w: bf16[16,8], x: f32[64]) -> (bf16[16,64], f32[8]) {
  %w = bf16[16,8]{1,0} parameter(0), sharding={devices=[1,8]<=[8]}
  %x.1 = f32[64]{0} parameter(1)
  %wc = bf16[16,8]{0,1} copy(%w)
  %ags = (bf16[16,8]{0,1}, bf16[16,64]{0,1}) all-gather-start(%wc), channel_id=2, dimensions={1}
  %agd = bf16[16,64]{0,1} all-gather-done(%ags)
  %z = s32[] constant(0)
  %init = (s32[], f32[64]{0}) tuple(%z, %x.1)
  %loop = (s32[], f32[64]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %y = f32[64]{0} get-tuple-element(%loop), index=1
  %rss = ((f32[64]{0}), f32[8]{0}) async-start(%y), calls=%wrapped_rs
  %rsd = f32[8]{0} async-done(%rss), calls=%wrapped_rs
  ROOT %out = (bf16[16,64]{0,1}, f32[8]{0}) tuple(%agd, %rsd)
}
"""


def test_async_forms_count_once() -> None:
    census = collective_census(_ASYNC_HLO)
    assert _counts(census) == {"all-reduce": (1, 4), "all-gather": (1, 1), "reduce-scatter": (1, 1)}
    assert census["all-reduce"]["executed_bytes"] == 4 * 64 * 4
    assert census["all-gather"]["static_bytes"] == 16 * 64 * 2  # the -done result, not the -start tuple
    assert census["reduce-scatter"]["static_bytes"] == 8 * 4
    (ag,) = all_gathers(_ASYNC_HLO)
    assert ag["shape"] == "bf16[16,64]" and ag["entry_params"] == [0]
    assert find_weight_all_gathers(_ASYNC_HLO, [(16, 64)])
    # a weight of another shape: no hit
    assert find_weight_all_gathers(_ASYNC_HLO, [(64, 64)]) == []


_COMBINED_HLO = """
HloModule combined, num_partitions=8

ENTRY %main (x: f32[4,8], w: s8[16,8]) -> (f32[4,64], s8[16,64]) {
  %x = f32[4,8]{1,0} parameter(0)
  %w = s8[16,8]{1,0} parameter(1)
  %wt = s8[16,8]{0,1} transpose(%w), dimensions={1,0}
  ROOT %ag = (f32[4,64]{1,0}, s8[16,64]{1,0}) all-gather(%x, %wt), channel_id=1, dimensions={1}
}
"""


def test_combined_all_gather() -> None:
    census = collective_census(_COMBINED_HLO)
    assert _counts(census) == {"all-gather": (1, 1)}
    assert census["all-gather"]["static_bytes"] == 4 * 64 * 4 + 16 * 64
    (ag,) = all_gathers(_COMBINED_HLO)
    assert ag["shape"] == "(f32[4,64], s8[16,64])" and ag["entry_params"] == [0, 1]
    assert find_weight_all_gathers(_COMBINED_HLO, [(16, 64)])
    assert not find_weight_all_gathers(_COMBINED_HLO, [(32, 64)])


def test_rejects_stablehlo(mesh) -> None:
    lowered = _smap(mesh, lambda x: jax.lax.psum(x, "model"), out_specs=P()).lower(_sds(mesh, (64, 16), P("model")))
    with pytest.raises(TypeError, match="compile"):
        collective_census(lowered)
    with pytest.raises(ValueError, match="StableHLO"):
        collective_census(lowered.as_text())


# ---------------------------------------------------------------------------------------------- all-gathers


def test_all_gather_detected(mesh) -> None:
    step = _smap(mesh, lambda x: jax.lax.all_gather(x, "model", tiled=True), out_specs=P(), check_vma=False)
    compiled = step.lower(_sds(mesh, (64, 16), P("model"))).compile()
    census = collective_census(compiled)
    assert _counts(census) == {"all-gather": (1, 1)}
    assert census["all-gather"]["static_bytes"] == 64 * 16 * 4
    (ag,) = all_gathers(compiled)
    assert ag["shape"] == "f32[64,16]" and ag["entry_params"] == [0]


def _stacked_layers(mesh, gather_weights: bool):
    """A scanned stack of 3 layers with int4 weights [3, 16, 64] column-split over 'model'."""
    num_layers, d, f = 3, 16, 64

    def fwd(x, w):
        def layer(h, w_l):
            if gather_weights:  # the anti-pattern the check must catch
                w_full = jax.lax.all_gather(w_l, "model", axis=1, tiled=True).astype(h.dtype)
                return jnp.tanh(h @ w_full[:, :d]), None
            y = h @ w_l.astype(h.dtype)  # [B, F/8], column-parallel
            return jnp.tanh(jax.lax.psum(y @ jnp.ones((f // 8, d), h.dtype), "model")), None

        return jax.lax.scan(layer, x, w)[0]

    step = jax.jit(
        jax.shard_map(fwd, mesh=mesh, in_specs=(P(), P(None, None, "model")), out_specs=P(), check_vma=False)
    )
    x = _sds(mesh, (4, d), P(), jnp.bfloat16)
    w = _sds(mesh, (num_layers, d, f), P(None, None, "model"), jnp.int4)
    return step.lower(x, w).compile(), {"w": w}


def test_weight_all_gather_inside_scan_is_found(mesh) -> None:
    compiled, weights = _stacked_layers(mesh, gather_weights=True)
    hits = find_weight_all_gathers(compiled, weights)
    assert len(hits) == 1
    (hit,) = hits
    assert hit["executed"] == 3 and hit["entry_params"] == [1]  # traced through loop tuple + fusions
    assert "global shape" in hit["reason"] and "weight shard" in hit["reason"]
    # Without shardings only the shape rule applies, and it still fires.
    assert find_weight_all_gathers(compiled, [(3, 16, 64)])


def test_sharded_weights_are_not_gathered(mesh) -> None:
    compiled, weights = _stacked_layers(mesh, gather_weights=False)
    assert find_weight_all_gathers(compiled, weights) == []
    assert all_gathers(compiled) == []
    assert _counts(collective_census(compiled)) == {"all-reduce": (1, 3)}


# ---------------------------------------------------------------------------------------------- memory


def test_memory_report(mesh) -> None:
    step = _smap(mesh, lambda x: jax.lax.psum(x, "model") * x)
    compiled = step.lower(_sds(mesh, (64, 16), P("model"))).compile()
    report = memory_report(compiled)
    assert report["argument_bytes"] == 8 * 16 * 4  # per device
    assert report["output_bytes"] == 8 * 16 * 4
    assert report["alias_bytes"] == 0
    assert report["temp_bytes"] is not None and report["temp_bytes"] >= 0
    assert report["total_bytes"] == 1024 - 0 + report["temp_bytes"]


def test_memory_report_missing_fields() -> None:
    partial = SimpleNamespace(memory_analysis=lambda: SimpleNamespace(argument_size_in_bytes=10))
    report = memory_report(partial)
    assert report["argument_bytes"] == 10 and report["temp_bytes"] is None and report["total_bytes"] is None

    def boom():
        raise NotImplementedError

    assert set(memory_report(SimpleNamespace(memory_analysis=boom)).values()) == {None}
    assert memory_report(SimpleNamespace(memory_analysis=lambda: None))["argument_bytes"] is None


def test_format_report(mesh) -> None:
    def f(x):
        return jax.lax.scan(lambda c, _: (jax.lax.psum(c, "model") * 0.5 + c, None), x, None, length=5)[0]

    compiled = _smap(mesh, f).lower(_sds(mesh, (64, 16), P("model"))).compile()
    text = format_report(collective_census(compiled), memory_report(compiled))
    row = next(line for line in text.splitlines() if line.startswith("all-reduce"))
    assert row.split()[1:3] == ["1", "5"] and "2.50 KiB" in row
    assert "argument_bytes" in text and "512 B" in text
    assert "(no collectives)" in format_report(collective_census(jax.jit(jnp.sin).lower(1.0).compile()))


# ---------------------------------------------------------------------------------------------- params


def test_param_bytes_counts_int4_as_half_a_byte() -> None:
    tree = {
        "q": jax.ShapeDtypeStruct((128, 64), jnp.int4),
        "u": jax.ShapeDtypeStruct((3,), jnp.uint4),  # 12 bits -> 2 bytes
        "scale": jax.ShapeDtypeStruct((128, 2), jnp.bfloat16),
        "bias": np.zeros((5,), np.float32),
    }
    assert param_bytes(tree) == 128 * 64 // 2 + 2 + 128 * 2 * 2 + 20
    assert param_bytes(jnp.zeros((7, 2), jnp.int4)) == 7
    with pytest.raises(TypeError, match=r"\['n'\]"):
        param_bytes({"n": 3})


def test_per_device_param_bytes_sharded_vs_replicated(mesh) -> None:
    sharded = _sds(mesh, (64, 16), P("model"))
    replicated = _sds(mesh, (64, 16), P())
    assert per_device_param_bytes({"w": sharded}) == 64 * 16 * 4 // 8
    assert per_device_param_bytes({"w": replicated}) == 64 * 16 * 4
    assert per_device_param_bytes([sharded, replicated]) == 512 + 4096
    int4 = _sds(mesh, (8, 64, 16), P(None, "model"), jnp.int4)
    assert per_device_param_bytes(int4) == 8 * 8 * 16 // 2
    # real arrays: one on a single device (others hold nothing), one split
    one = jax.device_put(jnp.zeros((100,), jnp.float32), jax.devices()[3])
    split = jax.device_put(jnp.zeros((64, 16), jnp.float32), NamedSharding(mesh, P("model")))
    per = device_param_bytes({"one": one, "split": split})
    assert per[jax.devices()[3]] == 400 + 512 and per[jax.devices()[0]] == 512
    assert per_device_param_bytes({"one": one, "split": split}) == 912
    with pytest.raises(ValueError, match="has no sharding"):
        per_device_param_bytes({"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
