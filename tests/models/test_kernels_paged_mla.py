"""The paged MLA attention kernel: exactness in the Pallas interpreter on CPU against the model's own XLA attention
over the densely gathered cache, lowering for TPU (Mosaic, compiled deviceless by libtpu) and CUDA (Pallas Triton),
and clear refusals.

The reference gathers each row's blocks through its table into a dense [B, S, Y] cache and runs
`mla.attend_live_prefix` with `MLA.absorbed_block` over it: the kernel must compute what that computes, for either
cache format; and so must the XLA path serving runs on CPU, which reads the pool in place (`cache.Paged`). The kernel
runs on a pool whose null block 0 is poisoned (NaN), so a row's table entries past its live blocks provably
contribute nothing (the reference gets the pool with a clean null block).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxspec.models import cache, mla
from jaxspec.models.kernels import lowering_for_gpu, paged_mla

TRITON_CALL = "__gpu$xla.gpu.triton"
N, C, R = 4, 128, 64  # small heads and latent; C is one TPU lane tile, the least the TPU form takes
SCALE = 0.13
LAYER = 1  # of two: the kernel reads the stack at a layer
# Same math and roundings; only the summation order inside a block's matmuls differs (XLA's einsum vs the kernel's
# dot): seen up to 1.4e-6 on outputs of size ~1 with blocks of 64.
FP32_TOL = 1e-5


def SLOW(*values):
    return pytest.param(*values, marks=pytest.mark.slow)


def make_tables(rng, lengths, block: int, per_row: int, shared: int) -> tuple[np.ndarray, int]:
    """Shuffled (non-contiguous) block ids >= 1 for each row's positions, 0 (the null block) past them; the first
    `shared` blocks of row 0 also serve every other row (a shared prefix). Returns (tables [B, per_row], blocks)."""
    need = [-(-n // block) for n in lengths]
    ids = iter(rng.permutation(np.arange(1, 1 + sum(need))))
    tables = np.zeros((len(lengths), per_row), np.int32)
    for b, k in enumerate(need):
        tables[b, :k] = [next(ids) for _ in range(k)]
    tables[1:, :shared] = tables[0, :shared]
    return tables, 1 + sum(need)


def scenario(seed: int, block: int, lengths, T: int, shared: int, fp8: bool, dtype=jnp.float32):
    """(kernel inputs on a pool with a poisoned null block, the same pool with a clean one). Each row's T queries
    sit at its last T positions (a verify of T tokens, causal among themselves)."""
    rng = np.random.default_rng(seed)
    per_row = max(-(-n // block) for n in lengths) + 1  # at least one null entry past every row
    tables, blocks = make_tables(rng, lengths, block, per_row, shared)
    pool = jnp.asarray(rng.standard_normal((2, blocks, block, C + R)), dtype)
    pool = cache.quantize_entries(pool) if fp8 else pool
    poisoned = pool.at[:, 0].set(255 if fp8 else jnp.nan)  # 0xff: an e4m3 NaN and a NaN scale
    B = len(lengths)
    q_pos = np.asarray(lengths)[:, None] - T + np.arange(T)
    q_abs = jnp.asarray(rng.standard_normal((B, T, N, C)), dtype)
    q_rope = jnp.asarray(rng.standard_normal((B, T, N, R)), dtype)
    return (q_abs, q_rope, poisoned, jnp.asarray(tables), jnp.asarray(q_pos, jnp.int32)), pool


def reference(q_abs_BTNC, q_rope_BTNR, pool, tables, q_pos_BT, *, paged: bool = False) -> jax.Array:
    """The model's XLA attention (absorbed form, live-prefix loop with kv_block = the pool's block) over the cache
    gathered densely through the block tables, or (`paged`) over the pool in place through the tables, as serving
    runs it."""
    B, K = tables.shape
    block = pool.shape[2]
    kv, layer = cache.Paged(pool, tables), LAYER
    if not paged:
        kv, layer = pool[LAYER][tables].reshape(B, K * block, pool.shape[-1])[None], 0
    block_fn = mla.MLA.absorbed_block(None, q_abs_BTNC, q_rope_BTNR, C)  # uses no module state
    init = mla.softmax_init(q_abs_BTNC, C)
    state = mla.attend_live_prefix(kv, layer, q_pos_BT, block_fn, init, SCALE, block, q_abs_BTNC.dtype)
    return mla.softmax_finish(state, q_abs_BTNC.dtype)


def run_kernel(args, backend: str) -> jax.Array:
    call = lambda *a: paged_mla.paged_mla_attention(*a, scale=SCALE, backend=backend, layer=LAYER, interpret=True)
    return jax.jit(call)(*args)


# lengths: 37 ends inside a block of 16, 48 and 64 on a block edge, 1 and 4 inside the first block.
@pytest.mark.parametrize(
    "backend, block, lengths, T, shared, fp8",
    [
        ("tpu", 16, (37, 48, 4), 4, 0, False),  # verify of 4 tokens, shuffled tables
        ("tpu", 16, (37, 64, 1), 1, 2, False),  # decode; rows 1 and 2 share row 0's first two blocks
        ("triton", 16, (37, 48, 4), 4, 1, False),
        ("tpu", 64, (130, 64, 200), 4, 1, False),
        ("tpu", 16, (37, 48, 5), 4, 2, True),  # fp8 cache entries
        ("triton", 16, (37, 48, 5), 4, 2, True),
        SLOW("triton", 64, (130, 64, 200), 4, 1, False),
        SLOW("tpu", 64, (250, 3, 128), 3, 1, True),
    ],
)
def test_interpret_equals_xla_over_the_gathered_cache(backend, block, lengths, T, shared, fp8):
    args, clean = scenario(sum(lengths) + block, block, lengths, T, shared, fp8)
    out = np.asarray(run_kernel(args, backend))
    expected = np.asarray(reference(*args[:2], clean, *args[3:]))
    assert np.isfinite(out).all()  # the poisoned null block was never read
    np.testing.assert_allclose(out, expected, rtol=FP32_TOL, atol=FP32_TOL)


@pytest.mark.parametrize("fp8", [False, True])
def test_xla_in_place_equals_the_gathered_cache(fp8):
    """Serving's XLA path reads the pool in place through shuffled, shared and partly filled tables, each row only as
    far as its own live blocks (the null block is NaN: reading it would show): it computes what the same attention
    computes over the cache gathered densely, value for value."""
    args, clean = scenario(11, 16, (37, 64, 3, 20), 3, 2, fp8)
    out = np.asarray(jax.jit(lambda *a: reference(*a, paged=True))(*args))
    expected = np.asarray(jax.jit(reference)(*args[:2], clean, *args[3:]))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, expected)


def test_bf16_follows_the_xla_roundings():
    args, clean = scenario(3, 16, (37, 48, 4), 4, 1, False, jnp.bfloat16)
    out = np.asarray(run_kernel(args, "tpu").astype(jnp.float32))
    expected = np.asarray(reference(*args[:2], clean, *args[3:]).astype(jnp.float32))
    np.testing.assert_allclose(out, expected, rtol=2e-2, atol=2e-2)  # a bf16 ulp, where accumulation order differs


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.integers(1, 70), min_size=1, max_size=4),
    st.sampled_from([8, 16, 32]),
    st.integers(1, 5),
    st.booleans(),
    st.sampled_from(["tpu", "triton"]),
    st.integers(0, 2**16),
)
def test_interpret_equals_xla_sampled(lengths, block, T, fp8, backend, seed):
    if backend == "triton" and block < 16:
        block = 16
    lengths = [max(n, T) for n in lengths]
    args, clean = scenario(seed, block, lengths, T, min(1, len(lengths) - 1), fp8)
    expected = np.asarray(reference(*args[:2], clean, *args[3:]))
    np.testing.assert_allclose(np.asarray(run_kernel(args, backend)), expected, rtol=FP32_TOL, atol=FP32_TOL)


def kimi_args(fp8: bool, B: int = 2, T: int = 4, heads: int = 64, block: int = 64, per_row: int = 64):
    """Abstract inputs at Kimi-K2.5 widths (C 512, R 64, 64 heads, blocks of 64; a verify of 4 tokens)."""
    C, R = 512, 64
    pool = jax.ShapeDtypeStruct((2, 1024, block, C + R + 4 * fp8), jnp.uint8 if fp8 else jnp.bfloat16)
    return (
        jax.ShapeDtypeStruct((B, T, heads, C), jnp.bfloat16),
        jax.ShapeDtypeStruct((B, T, heads, R), jnp.bfloat16),
        pool,
        jax.ShapeDtypeStruct((B, per_row), jnp.int32),
        jax.ShapeDtypeStruct((B, T), jnp.int32),
    )


def kernel_fn(backend: str):
    return jax.jit(lambda *a: paged_mla.paged_mla_attention(*a, scale=SCALE, backend=backend, layer=LAYER))


def check_one_call(text: str, target: str, kernel: str, pool: jax.ShapeDtypeStruct) -> None:
    """One `target` custom call running `kernel`, with the whole pool stack as an operand (never a gathered copy)."""
    calls = [line for line in text.splitlines() if f"stablehlo.custom_call @{target}(" in line]
    assert len(calls) == 1, f"expected one {target} call, found {len(calls)}"
    assert kernel in calls[0], f"the {target} call does not run {kernel}"
    dt = {jnp.dtype(jnp.uint8): "ui8", jnp.dtype(jnp.bfloat16): "bf16"}[jnp.dtype(pool.dtype)]
    operands = re.search(r":\s*\(([^()]*)\)\s*->", calls[0]).group(1).split(", ")
    assert f"tensor<{'x'.join(map(str, pool.shape))}x{dt}>" in operands, operands


@pytest.mark.parametrize("fp8", [False, True])
def test_tpu_mosaic_lowering_at_kimi_widths(fp8):
    args = kimi_args(fp8)
    text = jax.export.export(kernel_fn("tpu"), platforms=["tpu"])(*args).mlir_module()
    check_one_call(text, "tpu_custom_call", 'kernel_name = "_tpu_kernel"', args[2])


@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_triton_lowering_at_kimi_widths(fp8):
    args = kimi_args(fp8)
    allow = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]  # never stored: no stability needed
    with lowering_for_gpu():  # jax >= 0.11 lowers Triton kernels only for a named GPU
        text = jax.export.export(kernel_fn("triton"), platforms=["cuda"], disabled_checks=allow)(*args).mlir_module()
    check_one_call(text, TRITON_CALL, 'name = "_triton_kernel"', args[2])


@pytest.mark.parametrize("fp8", [False, SLOW(True)])
def test_tpu_compiles_deviceless_and_reads_a_row_major_pool_in_place(fp8):
    """libtpu compiles the kernel (Mosaic's own passes included) for a v5e chip. TPU's default layout for a
    576-wide pool puts the blocks axis minor (no lane padding); the kernel needs row-major, so a caller must keep
    the pool row-major (as pinned here) or each call relayouts the whole pool: pinned, nothing is copied."""
    from jax.experimental import topologies
    from jax.experimental.layout import Format, Layout

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4").devices[0]
    one = jax.sharding.SingleDeviceSharding(device)
    pinned = (one, one, Format(Layout(major_to_minor=(0, 1, 2, 3)), one), one, one)
    f = jax.jit(kernel_fn("tpu"), in_shardings=pinned, out_shardings=one)
    compiled = f.lower(*kimi_args(fp8)).compile()
    assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()
    assert compiled.memory_analysis().temp_size_in_bytes == 0


def test_bad_inputs_are_refused_by_name():
    args, _ = scenario(0, 16, (20, 9), 2, 0, False)
    q_abs, q_rope, pool, tables, q_pos = args
    call = lambda *a, backend="tpu": paged_mla.paged_mla_attention(*a, scale=SCALE, backend=backend, interpret=True)
    with pytest.raises(ValueError, match="backend must be 'tpu' or 'triton'"):
        call(*args, backend="cpu")
    with pytest.raises(ValueError, match="q_rope_BTNR"):
        call(q_abs, q_rope[:, :1], pool, tables, q_pos)
    with pytest.raises(ValueError, match="pool: expected"):
        call(q_abs, q_rope, pool[..., :-1], tables, q_pos)
    with pytest.raises(ValueError, match="tables: expected int32"):
        call(q_abs, q_rope, pool, tables.astype(jnp.float32), q_pos)
    with pytest.raises(ValueError, match="q_pos_BT"):
        call(q_abs, q_rope, pool, tables, q_pos[:, :1])
    with pytest.raises(ValueError, match="C % 128"):
        call(q_abs[..., :64], q_rope, pool[..., 64:], tables, q_pos)
    with pytest.raises(ValueError, match="Triton needs C, R and block powers of two"):
        call(q_abs, q_rope[..., :48], pool[..., :-16], tables, q_pos, backend="triton")
