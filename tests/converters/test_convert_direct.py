"""The converter's fast write path: one-shard arrays written by `shard_writer` (O_DIRECT where it can) must be the
files TensorStore writes, and a conversion through it (experts read into reused buffers, stored [E, out, in]) must
restore to exactly what loading the HF directory gives; version-1 outputs ([E, in, out]) must still load."""

import errno
import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from converters import shard_writer
from converters import target as conv
from jaxspec import load_target
from jaxspec.io.orbax import MARKER, group_dir, layer_group
from jaxspec.models.quant import Int4Array
from jaxspec.pytree import flatten
from tests.reference.hf_tiny import save_hf_model


def _refuse_o_direct(monkeypatch, when: str) -> None:
    """Make O_DIRECT fail as some file systems do: at open (tmpfs), or at the first read/write (alignment)."""
    real_open, real_close, real_write, real_preadv, direct = os.open, os.close, os.write, os.preadv, set()

    def fake_open(path, flags, *a):
        if flags & os.O_DIRECT and when == "open":
            raise OSError(errno.EINVAL, "O_DIRECT refused", str(path))
        fd = real_open(path, flags, *a)
        if flags & os.O_DIRECT:
            direct.add(fd)
        return fd

    def refuse(real):
        def call(fd, *a):
            if fd in direct:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, *a)

        return call

    def fake_close(fd):
        direct.discard(fd)
        real_close(fd)

    for name, fn in [("open", fake_open), ("close", fake_close), ("write", refuse(real_write))]:
        monkeypatch.setattr(os, name, fn)
    monkeypatch.setattr(os, "preadv", refuse(real_preadv))


def _tree():
    """Arrays the direct path takes (page-aligned, sizes on and off a 4 KiB multiple, unaligned) and ones it must
    leave to TensorStore (non-contiguous, scalar)."""
    rng = np.random.default_rng(0)
    aligned_odd = shard_writer.aligned_empty((3, 100, 37), ml_dtypes.bfloat16)
    aligned_odd[...] = rng.standard_normal(aligned_odd.shape)
    aligned_even = shard_writer.aligned_empty((2, 64, 128), np.float32)
    aligned_even[...] = rng.standard_normal(aligned_even.shape)
    return {
        "mlp": {"gate": aligned_odd, "up": aligned_even},
        "plain": rng.standard_normal((5, 7)).astype(np.float32),
        "ints": np.arange(10, dtype=np.int32),
        "transposed": rng.standard_normal((7, 3)).astype(np.float32).T,
        "scalar": np.float32(2.5),
    }


def _plain_writer() -> ocp.AsyncCheckpointer:
    th = ocp.type_handlers
    registry = th.create_type_handler_registry(
        (np.ndarray, th.NumpyHandler(deepcopy_host_arrays=False)), (np.number, th.ScalarHandler())
    )
    handler = ocp.PyTreeCheckpointHandler(
        use_compression=False, use_zarr3=True, use_ocdbt=False, type_handler_registry=registry
    )
    return ocp.AsyncCheckpointer(handler)


def _save(ck: ocp.AsyncCheckpointer, path, tree) -> None:
    ck.save(path, args=ocp.args.PyTreeSave(tree))
    ck.wait_until_finished()
    ck.close()


@pytest.mark.parametrize("o_direct", ["used", "open", "io"])  # used, or refused at open / at the first write
def test_shard_writer_writes_the_files_tensorstore_writes(o_direct, tmp_path, monkeypatch):
    calls = []
    write_shard = shard_writer.write_shard
    monkeypatch.setattr(shard_writer, "write_shard", lambda p, v: (calls.append(v.shape), write_shard(p, v)))
    tree = _tree()
    if o_direct != "used":  # the writer must fall back to a plain write
        _refuse_o_direct(monkeypatch, o_direct)
    _save(conv._writer(), tmp_path / "direct", tree)
    _save(_plain_writer(), tmp_path / "tensorstore", tree)
    assert sorted(calls) == sorted([(3, 100, 37), (2, 64, 128), (5, 7), (10,)])  # not the transposed one or scalar
    data = sorted(
        p.relative_to(tmp_path / "direct")
        for p in (tmp_path / "direct").rglob("*")
        if p.is_file() and not p.name.startswith(("_", "commit"))
    )
    assert len(data) == 12  # zarr.json and one shard for each of the 6 arrays
    for rel in data:
        assert (tmp_path / "direct" / rel).read_bytes() == (tmp_path / "tensorstore" / rel).read_bytes(), rel
    got = ocp.StandardCheckpointer().restore(tmp_path / "direct")
    for key, want in flatten(tree):
        np.testing.assert_array_equal(np.asarray(dict(flatten(got))[key]), np.asarray(want), err_msg=str(key))


def test_crc32c_known_answer():
    assert shard_writer.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    """1 dense + 4 MoE layers (the converter reuses a finished layer's buffers from the third MoE layer on), 6
    experts (not a multiple of 8), stored float32."""
    path = tmp_path_factory.mktemp("hf_five_layers")
    save_hf_model("kimi", path, seed=3, num_hidden_layers=5, n_routed_experts=6, num_experts_per_tok=2)
    return path


def _assert_same_params(ours, ref):
    want = dict(nnx.to_flat_state(ref.params))
    for path, var in nnx.to_flat_state(ours.params):
        got, exp = var.get_value(), want[path].get_value()
        assert not isinstance(exp, Int4Array)
        assert got.dtype == exp.dtype and got.shape == exp.shape and got.sharding == exp.sharding, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(exp), err_msg=str(path))


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])  # in place / cast
def test_conversion_through_reused_buffers_restores_exactly(dtype, five_layers, tmp_path):
    out = tmp_path / "out"
    report = conv.convert_target(five_layers, out, dtype=dtype, progress=False, verify=True)
    assert len(report.written) == 6 and report.bytes_written > 0
    stored = ocp.StandardCheckpointer().restore(group_dir(out, layer_group(4)))
    assert stored["mlp"]["gate"].shape == (6, 32, 64)  # [E, out=moe_intermediate, in=hidden], the HF layout
    ref = load_target(five_layers, dtype=jnp.dtype(dtype))
    _assert_same_params(load_target(out, dtype=jnp.dtype(dtype)), ref)

    # A version-1 output held the routed experts as [E, in, out]: rewrite this one that way, it must load the same.
    for layer in range(1, 5):
        d = group_dir(out, layer_group(layer))
        tree = ocp.StandardCheckpointer().restore(d)
        for proj in ("gate", "up", "down"):
            tree["mlp"][proj] = np.ascontiguousarray(np.swapaxes(tree["mlp"][proj], 1, 2))
        ck = ocp.StandardCheckpointer()
        ck.save(d.with_name(d.name + "_v1"), tree)
        ck.wait_until_finished()
        d.rename(d.with_name(d.name + "_v2"))
        d.with_name(d.name + "_v1").rename(d)
    marker = json.loads((out / MARKER).read_text())
    (out / MARKER).write_text(json.dumps(marker | {"version": 1}))
    _assert_same_params(load_target(out, dtype=jnp.dtype(dtype)), ref)


@pytest.mark.parametrize("o_direct", ["used", "open", "io"])  # used, or refused at open / at the first read
def test_read_many_matches_safetensors(o_direct, tmp_path, monkeypatch):
    """Tensors read in one pass (O_DIRECT windows of 16 MiB: one tensor spans several, small ones share one, and
    the order asked for is not the file order) equal what safetensors itself reads."""
    from safetensors.numpy import load_file, save_file

    from jaxspec.io.fp8 import RawSafetensorsDir

    rng = np.random.default_rng(1)
    tensors = {
        "a.weight": rng.standard_normal((3, 5)).astype(np.float32),
        "big.weight": rng.standard_normal((4500, 1000)).astype(np.float32),  # 18 MB: crosses a window
        "c.weight": rng.integers(0, 255, (7, 9), dtype=np.uint8),
        "d.weight": rng.standard_normal((333, 17)).astype(ml_dtypes.bfloat16),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    if o_direct != "used":
        _refuse_o_direct(monkeypatch, o_direct)
    ckpt = RawSafetensorsDir(tmp_path)
    outs = {n: shard_writer.aligned_empty(t.shape, t.dtype) for n, t in tensors.items()}
    ckpt.read_many([(n, outs[n]) for n in ("d.weight", "big.weight", "a.weight", "c.weight")])
    ref = load_file(tmp_path / "model.safetensors")
    for n in tensors:
        np.testing.assert_array_equal(outs[n], ref[n], err_msg=n)
