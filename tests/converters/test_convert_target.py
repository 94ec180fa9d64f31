"""jaxspec-convert target: HF safetensors (bf16-valued and INT4 K2.5-layout, multi-shard) -> Orbax, restored onto
1 and 8 devices with logits equal to loading the HF directory; resume after an interruption; refusals."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from converters import target as conv
from converters.__main__ import main
from jaxspec import CheckpointError, load_target
from jaxspec.io.orbax import MARKER, group_dir
from jaxspec.models.quant import Int4Array
from jaxspec.pytree import flatten
from sharding.mesh import make_mesh
from tests.reference.ct_checkpoint import write_int4_checkpoint

TOKENS = np.random.default_rng(5).integers(0, 256, (2, 12)).astype(np.int32)
POS = np.broadcast_to(np.arange(12, dtype=np.int32), (2, 12))


@pytest.fixture(scope="module")
def int4_k25(hf_checkpoint, tmp_path_factory):
    """INT4 experts, `language_model.` prefix, vision tensors, 3 shards with an index."""
    path = tmp_path_factory.mktemp("int4_k25_conv")
    src = hf_checkpoint("kimi")[0]
    write_int4_checkpoint(src, path, group_size=32, kimi_k25_layout=True, num_shards=3, vision_tensors=True)
    return path


def _groups(dst):
    """Every stored array of a conversion, by (group, key path)."""
    ck, out = ocp.StandardCheckpointer(), {}
    for d in sorted(p for p in (dst / "params").iterdir() if p.is_dir()):
        out.update({(d.name, *k): v for k, v in flatten(ck.restore(d))})
    return out


@pytest.mark.parametrize("kind", ["bf16", "int4_k25"])
def test_restore_matches_hf_on_1_and_8_devices(kind, hf_checkpoint, int4_k25, tmp_path):
    src = hf_checkpoint("kimi")[0] if kind == "bf16" else int4_k25
    report = conv.convert_target(src, tmp_path / "out", dtype="float32", progress=False, verify=True)
    assert report.skipped == [] and report.written[0] == "top" and len(report.written) == 4
    assert report.skipped_vision == (6 if kind == "int4_k25" else 0)
    assert report.verified[0] == "top"
    assert (tmp_path / "out" / "config.json").read_text() == (src / "config.json").read_text()
    for mesh in (None, make_mesh("1x8")):
        ours = load_target(tmp_path / "out", mesh=mesh, dtype=jnp.float32)
        ref = load_target(src, mesh=mesh, dtype=jnp.float32)
        want_params = dict(nnx.to_flat_state(ref.params))
        for path, var in nnx.to_flat_state(ours.params):
            got, want = var.get_value(), want_params[path].get_value()
            if isinstance(want, Int4Array):
                assert isinstance(got, Int4Array) and got.packed.dtype == jnp.uint8
                assert got.group_size == want.group_size and got.packed.sharding == want.packed.sharding, path
                assert got.scale.dtype == want.scale.dtype and got.scale.sharding == want.scale.sharding, path
                np.testing.assert_array_equal(np.asarray(got.packed), np.asarray(want.packed))
                np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))
            else:
                assert got.dtype == want.dtype and got.sharding == want.sharding, path
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path))
        # One compiled forward for both parameter trees (a Target is a jit static argument by identity).
        fwd = jax.jit(lambda params, ids, t=ours: t.apply(params, ids, POS, impl="expanded")[0])
        np.testing.assert_array_equal(np.asarray(fwd(ours.params, TOKENS)), np.asarray(fwd(ref.params, TOKENS)))


def test_resume_after_interruption_is_identical(int4_k25, tmp_path):
    full = tmp_path / "full"
    conv.convert_target(int4_k25, full, progress=False)

    class Killed(Exception):
        pass

    def kill_after_two(name):
        if name == "layer_00000":
            raise Killed(name)

    part = tmp_path / "part"
    with pytest.raises(Killed):
        conv.convert_target(int4_k25, part, progress=False, on_group_written=kill_after_two)
    assert not (part / MARKER).exists()
    with pytest.raises(CheckpointError, match="incomplete jaxspec conversion"):
        load_target(part)
    # A half-written group left behind by a kill (no .done record) is discarded, not trusted.
    shutil.rmtree(group_dir(part, "layer_00001"), ignore_errors=True)
    (group_dir(part, "layer_00001") / "d").mkdir(parents=True)
    (part / "params" / "layer_00002.orbax-checkpoint-tmp-123").mkdir()

    written = []
    report = conv.convert_target(int4_k25, part, progress=False, on_group_written=written.append)
    assert report.skipped == ["top", "layer_00000"] and written == report.written == ["layer_00001", "layer_00002"]
    a, b = _groups(full), _groups(part)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype
        np.testing.assert_array_equal(a[key], b[key], err_msg=str(key))
    with pytest.raises(FileExistsError, match="already holds a complete conversion"):
        conv.convert_target(int4_k25, part, progress=False)


def test_resume_refuses_a_source_whose_files_changed(int4_k25, tmp_path):
    src = shutil.copytree(int4_k25, tmp_path / "src")

    def stop(name):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        conv.convert_target(src, tmp_path / "o", progress=False, on_group_written=stop)
    # Same path, same names and shapes, other values: the finished "top" group no longer matches the source.
    shard = sorted(src.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    save_file({k: v + 1 if v.dtype.kind == "f" else v for k, v in tensors.items()}, shard)
    with pytest.raises(ValueError, match=rf"files changed since it started \({shard.name}\)"):
        conv.convert_target(src, tmp_path / "o", progress=False)


def test_rerun_with_other_settings_is_refused(int4_k25, tmp_path):
    def stop(name):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        conv.convert_target(int4_k25, tmp_path / "o", progress=False, on_group_written=stop)
    with pytest.raises(ValueError, match=r"different settings \(dtype\)"):
        conv.convert_target(int4_k25, tmp_path / "o", dtype="float32", progress=False)


def test_bad_checkpoint_reports_everything_and_writes_nothing(hf_checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(hf_checkpoint("kimi")[0], bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    tensors["model.layers.0.self_attn.kv_b_proj.weight"] = np.zeros((8, 32), np.float32)
    tensors["model.layers.1.mlp.surprise.weight"] = np.zeros((2,), np.float32)
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((2,), np.float32)  # MTP layer: skipped, counted
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        conv.convert_target(bad, tmp_path / "out", progress=False)
    msg = str(err.value)
    assert "3 problem(s)" in msg
    assert "missing tensor model.layers.2.mlp.experts.3.up_proj.weight (expected shape [32, 64])" in msg
    assert "model.layers.0.self_attn.kv_b_proj.weight: expected shape [256, 32], got [8, 32]" in msg
    assert "unexpected tensor model.layers.1.mlp.surprise.weight" in msg
    assert "layers.3" not in msg  # the MTP layer is skipped, not reported
    assert not (tmp_path / "out").exists()


def test_verify_reports_differences(hf_checkpoint, tmp_path):
    src = hf_checkpoint("kimi")[0]
    conv.convert_target(src, tmp_path / "out", dtype="float32", progress=False)
    changed = tmp_path / "changed"
    shutil.copytree(src, changed)
    tensors = load_file(changed / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    tensors["model.layers.2.mlp.experts.0.gate_proj.weight"] *= 2
    save_file(tensors, changed / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        conv.verify_conversion(changed, tmp_path / "out")
    msg = str(err.value)
    assert "2 problem(s)" in msg and "top/final_norm: values differ" in msg
    assert "layer_00002/mlp.gate: values differ" in msg


def test_not_a_conversion_and_not_hf_is_refused(hf_checkpoint, tmp_path):
    d = tmp_path / "params_only"
    (d / "params").mkdir(parents=True)
    shutil.copy(hf_checkpoint("kimi")[0] / "config.json", d)
    with pytest.raises(CheckpointError, match="incomplete jaxspec conversion.*no jaxspec_checkpoint.json"):
        load_target(d)


def test_cli(int4_k25, tmp_path, capsys):
    argv = ["target", "--src", str(int4_k25), "--dst", str(tmp_path / "o"), "--mesh", "1x8", "--verify"]
    assert main([*argv, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "wrote 4 group(s)" in out and "skipped 6 vision and 0 MTP tensor(s)" in out and "verified groups top" in out
    marker = json.loads((tmp_path / "o" / MARKER).read_text())
    assert marker["int4_experts"] and marker["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="mesh shape 1x3 needs 3 devices"):
        main(["target", "--src", str(int4_k25), "--dst", str(tmp_path / "p"), "--mesh", "1x3", "--no-progress"])


@pytest.mark.parametrize("damage", ["missing_shard", "corrupt_header", "outside_index", "pickle_only"])
def test_bad_input_is_refused_before_anything_is_marked_complete(damage, int4_k25, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(int4_k25, src)
    shards = sorted(src.glob("*.safetensors"))
    index_path = src / "model.safetensors.index.json"
    if damage == "missing_shard":
        shards[1].unlink()
        expected = "missing shard files"
    elif damage == "corrupt_header":
        data = shards[0].read_bytes()
        shards[0].write_bytes(data[:8] + b"{not json" + data[17:])
        expected = f"{shards[0].name}: not a readable safetensors file .*header"
    elif damage == "outside_index":
        index = json.loads(index_path.read_text())
        shutil.copy(shards[0], tmp_path / "elsewhere.safetensors")
        index["weight_map"] = {
            k: "../elsewhere.safetensors" if v == shards[0].name else v for k, v in index["weight_map"].items()
        }
        index_path.write_text(json.dumps(index))
        expected = "points outside the checkpoint directory"
    else:
        for f in (*shards, index_path):
            f.unlink()
        (src / "pytorch_model.bin").write_bytes(b"\x80\x04 a pickle that must never be loaded")
        expected = "no \\*.safetensors files"
    with pytest.raises(Exception, match=expected):
        conv.convert_target(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / MARKER).exists()
