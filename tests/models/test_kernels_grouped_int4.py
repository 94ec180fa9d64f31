"""The grouped INT4 matmul kernel: tile plan, exactness in the Pallas interpreter on CPU, and lowering for TPU
(Mosaic) and CUDA (Pallas Triton) without the device.

What the lowering tests check: `jax.export(..., platforms=[...])` runs the Pallas -> Mosaic (TPU) and Pallas ->
Triton (CUDA) lowerings in Python and emits the `tpu_custom_call` / `triton_kernel_call`. The device compilers
(Mosaic's layout passes, ptxas) run only on the device: that part is checked by benchmarks/device_check.sh.
"""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models.kernels import grouped_int4, lowering_for_gpu
from jaxspec.models.quant import Int4Array, quantize

TRITON_CALL = "__gpu$xla.gpu.triton"


def SLOW(*values):
    return pytest.param(*values, marks=pytest.mark.slow)


def sorted_experts(rng, n_pairs: int, n_experts: int, foreign: float, rows: int) -> np.ndarray:
    """Expert ids of n_pairs rows, some foreign (id n_experts), sorted, padded with foreign ids to whole windows plus
    one spare window (as routed_experts does)."""
    ids = rng.integers(0, n_experts, n_pairs)
    ids[rng.random(n_pairs) < foreign] = n_experts
    return np.sort(np.pad(ids, (0, rows + -n_pairs % rows), constant_values=n_experts)).astype(np.int32)


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize(
    "n_pairs, n_experts, rows",
    [(8, 48, 8), (300, 20, 16), (5, 3, 16), SLOW(8, 1, 8), SLOW(32, 12, 8)],
)
def test_plan_covers_every_local_row_once_with_hit_experts_only(n_pairs, n_experts, rows, aligned):
    rng = np.random.default_rng(n_pairs + n_experts)
    expert = sorted_experts(rng, n_pairs, n_experts, 0.3, rows)
    plan = grouped_int4.plan_tiles(jnp.asarray(expert), n_experts, rows, aligned=aligned)
    tiles = jax.tree.map(np.asarray, plan)
    num = int(tiles.num[0])
    covered = np.zeros(len(expert), int)
    for t in range(num):
        r = np.arange(tiles.start[t], tiles.start[t] + rows)
        mine = r[(r >= tiles.lo[t]) & (r < tiles.hi[t])]
        assert len(mine) and (expert[mine] == tiles.expert[t]).all()
        assert not aligned or tiles.start[t] % rows == 0
        covered[mine] += 1
    np.testing.assert_array_equal(covered, expert < n_experts)
    hit, counts = np.unique(expert[expert < n_experts], return_counts=True)
    assert set(tiles.expert[:num].tolist()) == set(hit.tolist())
    # Unaligned: exactly ceil(rows of e / rows) tiles per hit expert. Aligned: at most one more per window boundary.
    assert num == (-(-counts // rows)).sum() if not aligned else num <= len(expert) // rows + len(hit) - 1
    # Tiles past `num` repeat the last live tile (the kernel loads nothing new for them).
    if num:
        assert (tiles.expert[num:] == tiles.expert[num - 1]).all() and (tiles.start[num:] == tiles.start[num - 1]).all()


def random_int4(rng, n_experts: int, n_in: int, n_out: int, group: int) -> Int4Array:
    return quantize(rng.standard_normal((n_experts, n_in, n_out)).astype(np.float32), group)


def reference(x, w: Int4Array, expert) -> np.ndarray:
    """Row r times its expert's weight, dequantised by Int4Array (checked bit-exact against compressed-tensors)."""
    dense = np.asarray(w.dequantize(jnp.float32))
    return np.stack([x[r] @ dense[e] if e < len(dense) else np.zeros(dense.shape[-1]) for r, e in enumerate(expert)])


@pytest.mark.parametrize(
    "backend, n_experts, n_pairs",
    [("tpu", 12, 40), ("triton", 20, 90), SLOW("tpu", 1, 16), SLOW("triton", 1, 16), SLOW("tpu", 20, 90)]
    + [SLOW("triton", 12, 40)],
)
def test_interpret_equals_dense_reference(backend, n_experts, n_pairs):
    rng = np.random.default_rng(n_experts)
    rows, n_in, n_out, group = 16, 64, 256, 32
    expert = sorted_experts(rng, n_pairs, n_experts, 0.25, rows)
    w = random_int4(rng, n_experts, n_in, n_out, group)
    x = rng.standard_normal((len(expert), n_in)).astype(np.float32)
    tiles = grouped_int4.plan_tiles(jnp.asarray(expert), n_experts, rows, aligned=backend == "tpu")
    run = jax.jit(
        lambda x, w, tiles: grouped_int4.grouped_matmul(
            x, w, tiles, rows=rows, out_dtype=jnp.float32, backend=backend, cols=128, interpret=True
        )
    )
    out = np.asarray(run(jnp.asarray(x), w, tiles))
    local = expert < n_experts
    np.testing.assert_allclose(out[local], reference(x, w, expert)[local], rtol=1e-5, atol=1e-4)


def export_text(backend: str, platform: str, n_in: int, n_out: int, rows: int) -> str:
    n_experts, n_rows, group = 48, 4 * rows, 32
    w = Int4Array(
        jax.ShapeDtypeStruct((n_experts, n_in // 2, n_out), jnp.uint8),
        jax.ShapeDtypeStruct((n_experts, n_in // group, n_out), jnp.bfloat16),
        group,
    )
    expert = jax.ShapeDtypeStruct((n_rows,), jnp.int32)
    x = jax.ShapeDtypeStruct((n_rows, n_in), jnp.bfloat16)

    def f(x, w, expert):
        tiles = grouped_int4.plan_tiles(expert, n_experts, rows, aligned=backend == "tpu")
        return grouped_int4.grouped_matmul(x, w, tiles, rows=rows, out_dtype=jnp.bfloat16, backend=backend)

    # Triton kernel calls carry no cross-version stability guarantee: allow them (this export is never stored).
    allow = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    target = lowering_for_gpu() if platform == "cuda" else contextlib.nullcontext()  # jax >= 0.11 needs the GPU named
    with target:
        return jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=allow)(x, w, expert).mlir_module()


def check_kernel_call(text: str, target: str, kernel: str, n_in: int, n_out: int, rows: int) -> None:
    """The exported module makes exactly one call to the `kernel` lowering (`target` custom call), which reads the
    packed INT4 weights and their group scales as stored (never a dequantised copy) and returns the [4*rows, n_out]
    bf16 result that `main` returns."""
    calls = [line for line in text.splitlines() if f"stablehlo.custom_call @{target}(" in line]
    assert len(calls) == 1, f"expected one {target} call, found {len(calls)}"
    assert kernel in calls[0], f"the {target} call does not run {kernel}"
    operands, result = re.search(r":\s*\(([^()]*)\)\s*->\s*(tensor<[^>]*>)\s*loc", calls[0]).groups()
    operands = operands.split(", ")
    out = f"tensor<{4 * rows}x{n_out}xbf16>"
    assert result == out and f"-> ({out} " in text, (result, out)
    packed, scale = rf"tensor<(1x)?48x{n_in // 2}x{n_out}xui8>", rf"tensor<(1x)?48x{n_in // 32}x{n_out}xbf16>"
    count = lambda pattern: sum(re.fullmatch(pattern, o) is not None for o in operands)
    assert (count(packed), count(scale), count(rf"tensor<(1x)?48x{n_in}x{n_out}x\w+>")) == (1, 1, 0), operands


@pytest.mark.parametrize("n_in, n_out", [(7168, 2048), SLOW(2048, 7168)])  # Kimi's gate/up and down shapes
def test_tpu_mosaic_lowering_at_kimi_widths(n_in, n_out):
    text = export_text("tpu", "tpu", n_in, n_out, rows=16)
    check_kernel_call(text, "tpu_custom_call", 'kernel_name = "_tpu_kernel"', n_in, n_out, rows=16)


@pytest.mark.parametrize("n_in, n_out", [(7168, 2048), SLOW(2048, 7168)])
def test_cuda_triton_lowering_at_kimi_widths(n_in, n_out):
    text = export_text("triton", "cuda", n_in, n_out, rows=16)
    check_kernel_call(text, TRITON_CALL, 'name = "_triton_kernel"', n_in, n_out, rows=16)


def test_bad_shapes_and_backend_are_refused():
    w = random_int4(np.random.default_rng(0), 2, 64, 128, 32)
    tiles = grouped_int4.plan_tiles(jnp.zeros(16, jnp.int32), 2, 16, aligned=True)
    with pytest.raises(ValueError, match="do not tile"):
        grouped_int4.grouped_matmul(jnp.zeros((12, 64)), w, tiles, rows=16, out_dtype=jnp.float32, backend="tpu")
    with pytest.raises(ValueError, match="backend must be 'tpu' or 'triton'"):
        grouped_int4.grouped_matmul(jnp.zeros((16, 64)), w, tiles, rows=16, out_dtype=jnp.float32, backend="cpu")
