"""One test per finding of the hostile-new-user probe (issue 18): each failed before the fix.

Checkpoint cases edit copies of the session's tiny HF checkpoint; nothing here compiles a model except the
generate-argument and CLI tests, which share one random tiny target.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from converters import target as conv
from jaxspec import CheckpointError, KimiConfig, Target, load_target
from jaxspec.config import ConfigError
from jaxspec.decoding.generate import _prompt_ids, generate
from jaxspec.decoding.sampling import Sampling, sample, warp
from sharding.mesh import make_mesh


def _copy(hf_checkpoint, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(hf_checkpoint("kimi")[0], dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _shard(path, files: dict[str, list[str]]):
    """Split model.safetensors into the named files (tensor lists) and write an index for them."""
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    weight_map = {}
    for f, names in files.items():
        save_file({n: tensors.pop(n) for n in names}, path / f)
        weight_map.update(dict.fromkeys(names, f))
    save_file(tensors, path / "rest.safetensors")
    weight_map.update(dict.fromkeys(tensors, "rest.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return weight_map


# ------------------------------------------------------------------ layers past num_hidden_layers
def test_config_with_fewer_layers_than_the_weights_is_refused(hf_checkpoint, tmp_path):
    """HF writes num_nextn_predict_layers 1; layer 2 of a 3-layer checkpoint has no eh_proj, so it is no MTP layer."""
    path = _copy(hf_checkpoint, tmp_path)
    _edit_config(path, num_hidden_layers=2)
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.2\.self_attn\.q_a_proj\.weight"):
        load_target(path)


@pytest.mark.parametrize("nextn", [0, 1])
def test_converter_refuses_a_config_with_fewer_layers(hf_checkpoint, tmp_path, nextn):
    """With HF's default of one MTP layer too: layer 2 holds no eh_proj, so it is no MTP layer."""
    path = _copy(hf_checkpoint, tmp_path)
    _edit_config(path, num_hidden_layers=2, num_nextn_predict_layers=nextn)
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.2\."):
        conv.convert_target(path, tmp_path / "out", progress=False)


def test_stray_tensor_in_the_mtp_layer_is_reported(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint, tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)  # a real MTP tensor: skipped
    tensors["model.layers.3.mlp.surprise.weight"] = np.zeros((2,), np.float32)
    tensors["model.layers.4.enorm.weight"] = np.zeros((64,), np.float32)  # past the config's one MTP layer
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_target(path)
    msg = str(err.value)
    assert "2 problem(s)" in msg and "eh_proj" not in msg
    assert "unexpected tensor model.layers.3.mlp.surprise.weight" in msg
    assert "unexpected tensor model.layers.4.enorm.weight" in msg


# ------------------------------------------------------------------ sampling
@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 5e-324])
def test_tiny_temperature_is_the_greedy_limit_not_nan(temperature):
    logits = jnp.array([[0.5, 3.0, -1.0, 2.5], [-jnp.inf, 1.0, 4.0, 4.0]])
    logp = warp(logits, Sampling(temperature=temperature))
    assert not jnp.isnan(logp).any()
    np.testing.assert_allclose(jnp.exp(logp), [[0, 1, 0, 0], [0, 0, 0.5, 0.5]])
    keys = jax.random.split(jax.random.key(0), 16)
    picks = jax.vmap(lambda k: sample(k, logits, Sampling(temperature=temperature)))(keys)
    assert (picks[:, 0] == 1).all() and set(np.asarray(picks[:, 1]).tolist()) <= {2, 3}


# ------------------------------------------------------------------ the index and the files it names
def test_index_entries_outside_the_directory_are_refused(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint, tmp_path)
    weight_map = _shard(path, {"a.safetensors": ["model.norm.weight"]})
    shutil.move(path / "a.safetensors", tmp_path / "x.safetensors")
    for target in ("../x.safetensors", str(tmp_path / "x.safetensors"), "/etc/passwd"):
        weight_map["model.norm.weight"] = target
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(CheckpointError, match="points outside the checkpoint directory"):
            load_target(path)


@pytest.mark.parametrize(
    "damage, pattern",
    [
        ("corrupt", r"model\.safetensors: not a readable safetensors file"),
        ("index_not_json", r"model\.safetensors\.index\.json: not valid JSON"),
        ("no_weight_map", r"model\.safetensors\.index\.json: expected an object with a 'weight_map'"),
        ("wrong_shard", r"maps \['model\.norm\.weight'\] to rest\.safetensors, which does not contain them"),
    ],
)
def test_broken_files_are_named(hf_checkpoint, tmp_path, damage, pattern):
    path = _copy(hf_checkpoint, tmp_path)
    if damage == "corrupt":
        (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    else:
        weight_map = _shard(path, {"a.safetensors": ["model.norm.weight"]})
        index = path / "model.safetensors.index.json"
        if damage == "index_not_json":
            index.write_text("{weight_map: ")
        elif damage == "no_weight_map":
            index.write_text(json.dumps({"metadata": {}}))
        else:
            weight_map["model.norm.weight"] = "rest.safetensors"
            index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=pattern):
        load_target(path)


# ------------------------------------------------------------------ dtypes and config values
def test_integer_weights_are_refused(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint, tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].astype(np.int32)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.embed_tokens\.weight: expected a float dtype .*, got I32"):
        load_target(path)


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"rms_norm_eps": -1}, r"rms_norm_eps: expected a positive finite number, got -1"),
        ({"rms_norm_eps": 0}, r"rms_norm_eps: expected a positive finite number"),
        ({"num_attention_heads": 0}, r"^num_attention_heads: expected a positive integer, got 0"),
        ({"num_attention_heads": 0, "num_key_value_heads": 0}, r"^num_attention_heads: expected a positive"),
    ],
)
def test_bad_config_values_name_the_field(hf_checkpoint, changes, pattern):
    raw = json.loads((hf_checkpoint("kimi")[0] / "config.json").read_text())
    with pytest.raises(ConfigError, match=pattern):
        KimiConfig.from_hf_config({**raw, **changes})


# ------------------------------------------------------------------ the mesh
def test_mesh_smaller_than_the_devices_says_how_to_pick_a_subset():
    from sharding.mesh import select_devices

    with pytest.raises(
        ValueError, match=r"needs 4 devices, 8 available; .*devices=jax\.devices\(\)\[:4\].*--devices 4"
    ):
        make_mesh("1x4")
    assert dict(make_mesh("1x4", select_devices("4-7")).shape) == {"data": 1, "model": 4}
    assert [d.id for d in select_devices("0,2,4,6")] == [jax.devices()[i].id for i in (0, 2, 4, 6)]
    for bad in ("0", "9", "1,1", "x"):
        with pytest.raises(ValueError, match="devices"):
            select_devices(bad)


# ------------------------------------------------------------------ the generate API
@pytest.fixture(scope="module")
def tiny_target():
    # Abstract weights: generate checks its arguments before it touches (or compiles for) the parameters.
    return Target.abstract(KimiConfig.preset("tiny"), dtype=jnp.float32)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"seed": 1.5}, r"seed: expected an integer in \[0, 2\*\*32\), got 1\.5"),
        ({"seed": None}, r"seed: expected an integer"),
        ({"seed": 2**70}, r"seed: expected an integer"),
        ({"seed": True}, r"seed: expected an integer"),
        ({"stop": 268}, r"stop: expected a list of token ids, got 268"),
        ({"stop": ["x"]}, r"stop: token ids must be integers in \[0, vocab_size=256\), got \['x'\]"),
        ({"stop": [1.5]}, r"stop: token ids must be integers .* got \[1\.5\]"),
        ({"stop": [256]}, r"stop: token ids must be integers"),
    ],
)
def test_generate_refuses_bad_seed_and_stop_by_name(tiny_target, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        generate(tiny_target, None, [[1, 2, 3]], num_steps=0, max_new_tokens=2, **kwargs)


def test_numpy_prompt_arrays_are_token_ids():
    assert _prompt_ids(np.array([5, 6, 7], np.int64), None) == [[5, 6, 7]]
    assert _prompt_ids(np.array([[5, 6], [7, 8]], np.int32), None) == [[5, 6], [7, 8]]
    with pytest.raises(ValueError, match=r"prompts: a numpy array must be \[T\] or \[B, T\]"):
        _prompt_ids(np.zeros((1, 2, 3), np.int32), None)
