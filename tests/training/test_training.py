"""Drafter training end to end on a tiny HF target: data generation (resumable), the training-time test against the
drafter's own cached inference and against `speculators`, loss going down, exact resume, data parallel, export; an
MLA drafter (`attention="mla"`) trained, checked against HF DeepseekV3 attention, exported and restored; and an
EAGLE 3.1 drafter (`variant="eagle3.1"`) trained and checked against speculators' EAGLE 3.1 forward.

One target, one dataset and one uninterrupted training run per module (compiles dominate the time on CPU). The
target's lm_head is scaled up so its next-token distributions are peaked (a random model's are nearly uniform, and
nothing could be learned about them).
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from transformers import DeepseekV3Config

from jaxspec.io import load_drafter, load_target, save_drafter
from jaxspec.training import DatasetError, generate_dataset, load_dataset, train_drafter
from jaxspec.training.ttt import ttt_logits
from sharding.mesh import make_mesh
from tests.reference import eagle3_mla as mla_ref
from tests.reference import eagle3_speculators as ref
from tests.reference.hf_tiny import make_hf_model

V = 256
STEPS, BATCH, NEW = 16, 8, 16
T = 12  # probe sequence length (one compile shared by the TTT and export tests)
# Small drafter (4 heads, 2 KV heads), 64-token draft vocabulary, a learning rate for a tiny model. Two TTT steps keep
# the compile short; the unroll itself is checked at three steps against inference and speculators.
RUN = dict(
    draft_vocab_size=64, steps=STEPS, batch_size=BATCH, lr=3e-3, warmup=2, seed=1, checkpoint_every=5, ttt_depth=2
)
RUN |= dict(heads=4, kv_heads=2, intermediate_size=96, progress=False)
# The MLA drafter: the target's MLA geometry with 4 heads, the full vocabulary (as the published Kimi MLA drafter).
RUN_MLA = RUN | dict(attention="mla", kv_heads=None, draft_vocab_size=V)
RUN_31 = RUN | dict(variant="eagle3.1")


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / b.std())


def read_log(out) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    model = make_hf_model("kimi", seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    path = tmp_path_factory.mktemp("target")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(hf_dir):
    return load_target(hf_dir, dtype=jnp.float32)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(2, V, int(n)).tolist() for n in rng.integers(3, 9, 16)]


@pytest.fixture(scope="module")
def dataset(target, prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    generate_dataset(target, prompts, out, max_new_tokens=NEW, temperature=0.8, seed=3, shard_size=8, progress=False)
    return out


@pytest.fixture(scope="module")
def trained(target, dataset, tmp_path_factory):
    """(drafter, out dir) of the uninterrupted reference run."""
    out = tmp_path_factory.mktemp("run")
    return train_drafter(target, dataset, out, **RUN), out


# ----------------------------------------------------------------------------------------------- data
def test_dataset_layout_and_resumed_generation(target, prompts, dataset, tmp_path):
    data = load_dataset(dataset, vocab_size=V)
    m = data.manifest
    assert m["complete"] and m["num_shards"] == 2 and m["num_sequences"] == len(prompts) == len(data)
    assert data.seq_len == max(map(len, prompts)) + NEW and m["target"]["vocab_size"] == V
    for row, p, mask in zip(data.ids, prompts, data.loss_mask, strict=True):
        assert row[: len(p)].tolist() == p and not mask[: len(p)].any()  # prompts are never learned
        n = mask.sum()
        assert 1 <= n <= NEW and mask[len(p) : len(p) + n].all()  # the response, up to a stop token
        assert not row[len(p) + n :].any()  # padding
    assert m["num_response_tokens"] == data.loss_mask.sum()

    # An interrupted run (a shard missing, a partial temp file, no completion mark) resumes to the same data:
    # per-shard sampling seeds do not depend on what was already done.
    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    (copy / "shard_00001.npz").unlink()
    (copy / "shard_00001.npz.tmp").write_bytes(b"partial")
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(DatasetError, match="interrupted; rerun it with the same settings"):
        load_dataset(copy)
    generate_dataset(target, prompts, copy, max_new_tokens=NEW, temperature=0.8, seed=3, shard_size=8, progress=False)
    again = load_dataset(copy)
    np.testing.assert_array_equal(again.ids, data.ids)
    np.testing.assert_array_equal(again.loss_mask, data.loss_mask)
    assert not list(copy.glob("*.tmp"))
    with pytest.raises(DatasetError, match=r"different settings \(max_new_tokens, seed, seq_len differ\)"):
        generate_dataset(target, prompts, copy, max_new_tokens=4, temperature=0.8, seed=4, shard_size=8)


# ----------------------------------------------------------------------------------------------- TTT
def test_ttt_equals_incremental_inference(target, trained):
    """The TTT unroll equals the drafter's cached inference: a first step over the prefix, then draft steps that feed
    back h2 with the next tokens, as the speculative loop runs it (here with every start position t at once)."""
    drafter, J = trained[0], 3
    ids = np.random.default_rng(1).integers(0, V, (1, T))
    aux = np.asarray(drafter.aux_hidden(ids))
    ttt = np.asarray(ttt_logits(drafter, ids, aux, J))[:, 0]  # [J, T, U]

    # Batch row t is the chain started at position t. The first step pairs state p with token p+1 at position p;
    # draft step j runs at position t+j with token t+1+j (0 past the end) and step j-1's h2 of row t. Cache entries
    # past a row's position are stale first-step ones, masked by position.
    ids, aux, rows = ids[0], aux[0], np.arange(T)
    next_ids = np.append(ids[1:], 0)
    cache = drafter.init_cache(T, T + J)
    logits, h2, cache = drafter.forward(
        np.tile(next_ids, (T, 1)), np.tile(aux, (T, 1, 1)), np.tile(rows, (T, 1)), cache, first_step=True
    )
    want, h = [np.asarray(logits)[rows, rows]], np.asarray(h2)[rows, rows][:, None]
    for j in range(1, J):
        token = np.where(rows + 1 + j < T, ids[np.minimum(rows + 1 + j, T - 1)], 0)[:, None]
        logits, h, cache = drafter.forward(token, h, (rows + j)[:, None], cache, first_step=False)
        want.append(np.asarray(logits)[:, 0])
    for j in range(J):
        np.testing.assert_allclose(ttt[j], want[j], atol=2e-5, rtol=0, err_msg=f"TTT step {j}")
    assert np.abs(ttt[0] - ttt[1]).max() > 1e-2  # the steps differ: the comparison can see a misalignment


# ----------------------------------------------------------------------------------------------- training
def test_loss_decreases_and_accuracy_rises(trained):
    log = read_log(trained[1])
    assert [e["step"] for e in log] == list(range(1, STEPS + 1))
    loss, acc = np.array([e["loss"] for e in log]), np.array([e["acc_j"] for e in log])
    assert loss[-4:].mean() < loss[:4].mean() - 0.3, loss
    assert acc[-4:, 0].mean() > acc[:4, 0].mean() + 0.1, acc[:, 0]
    assert all(len(e["loss_j"]) == len(e["acc_j"]) == 2 and e["grad_norm"] > 0 for e in log)


def test_resume_reproduces_the_uninterrupted_run(target, dataset, trained, tmp_path):
    """Crash at step 7 (no save: resume from the step-5 checkpoint), Ctrl-C at step 12 (saved), resume to the end."""
    out = tmp_path / "run"

    def stop_at(step, exc):
        def hook(s, metrics):
            if s == step:
                raise exc

        return hook

    with pytest.raises(RuntimeError, match="crash"):
        train_drafter(target, dataset, out, **RUN, on_step=stop_at(7, RuntimeError("crash")))
    assert len(read_log(out)) == 7 and sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [5]
    with pytest.raises(FileExistsError, match="pass resume=True"):
        train_drafter(target, dataset, out, **RUN)
    with pytest.raises(ValueError, match=r"cannot resume, the run's settings changed: lr \(0.003 -> 0.001\)"):
        train_drafter(target, dataset, out, **{**RUN, "lr": 1e-3}, resume=True)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(target, dataset, out, **RUN, resume=True, on_step=stop_at(12, KeyboardInterrupt()))
    assert 12 in [int(p.name) for p in (out / "checkpoints").iterdir()]
    resumed = train_drafter(target, dataset, out, **RUN, resume=True)

    want = read_log(trained[1])
    got = read_log(out)
    assert [e["step"] for e in got] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([e["loss"] for e in got], [e["loss"] for e in want], rtol=1e-6)
    np.testing.assert_allclose([e["acc_j"] for e in got], [e["acc_j"] for e in want], rtol=1e-6)
    for key, var in trained[0].params.items():
        np.testing.assert_allclose(np.asarray(resumed.params[key].get_value()), np.asarray(var.get_value()), atol=1e-6)


@pytest.mark.slow  # 14-21 s: its own compile of the training step for a 4-device mesh
def test_data_parallel_matches_single_device(target, dataset, trained, tmp_path):
    """The same run on a 2x2 mesh (batch over 2 devices; the target's vocabulary, so the embedding lookup and the
    draft-vocabulary gather, split over 2): the same per-step loss."""
    sharded = target.on_mesh(make_mesh("2x2", jax.devices()[:4]))

    def stop(step, metrics):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_drafter(sharded, dataset, tmp_path / "dp", **RUN, on_step=stop)
    got, want = read_log(tmp_path / "dp"), read_log(trained[1])[:3]
    np.testing.assert_allclose([e["loss"] for e in got], [e["loss"] for e in want], rtol=1e-5)
    np.testing.assert_allclose([e["grad_norm"] for e in got], [e["grad_norm"] for e in want], rtol=1e-4)
    with pytest.raises(ValueError, match=r"batch_size 7 is not divisible by the mesh's data axis \(2\)"):
        train_drafter(sharded, dataset, tmp_path / "bad", **{**RUN, "batch_size": 7})


# ----------------------------------------------------------------------------------------------- export
def test_export_loads_in_jaxspec_and_speculators(target, hf_dir, trained, tmp_path):
    drafter, out = trained
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    loaded = load_drafter(out, target, dtype=jnp.float32)
    assert loaded.config == drafter.config and loaded.shared == ("embed",)
    assert loaded.config.draft_vocab_size == 64 and loaded.capture_layers == (0, 1, 2)
    np.testing.assert_array_equal(loaded.d2t, drafter.d2t)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, V, (1, T))
    aux = np.asarray(drafter.aux_hidden(ids))
    np.testing.assert_array_equal(np.asarray(loaded.logits(aux, ids)), np.asarray(drafter.logits(aux, ids)))

    # The published implementation, fed the same target states, drafts what our TTT unroll drafts at every step.
    save_drafter(drafter, tmp_path / "spec", format="speculators", verifier=str(hf_dir))
    spec_cfg = Eagle3SpeculatorConfig.from_pretrained(tmp_path / "spec")
    spec_cfg.transformer_layer_config._attn_implementation = "eager"  # its default flex attention lacks GQA on CPU
    model = Eagle3DraftModel.from_pretrained(tmp_path / "spec", config=spec_cfg).eval()
    with torch.no_grad():  # the export has no embedding (it is the target's); speculators re-initialises a missing one
        model.embed_tokens.weight.copy_(torch.from_numpy(np.asarray(target.params["embed"].get_value())))
    next_ids = np.append(ids[0, 1:], 0)  # speculators pairs row t's state with the token it is given at row t
    theirs = ref.draft_logits(model, aux[0], next_ids, steps=3)
    ours = np.asarray(ttt_logits(drafter, ids, aux, 3))[:, 0]
    for j in range(3):
        assert rel_err(ours[j], theirs[j]) <= 1e-4, f"step {j}"


def test_bad_training_input(target, dataset, tmp_path):
    with pytest.raises(ValueError, match=r"draft_vocab_size: 300 exceeds the target's vocab_size 256"):
        train_drafter(target, dataset, tmp_path / "a", **{**RUN, "draft_vocab_size": 300})
    with pytest.raises(ValueError, match=r"warmup: expected an integer in \[0, steps=16\)"):
        train_drafter(target, dataset, tmp_path / "a", **{**RUN, "warmup": 16})
    with pytest.raises(ValueError, match=r"kv_heads: 3 must divide heads 4"):
        train_drafter(target, dataset, tmp_path / "a", **{**RUN, "kv_heads": 3})
    with pytest.raises(ValueError, match=r"kv_heads: an MLA drafter has one KV head per query head \(4\), got 2"):
        train_drafter(target, dataset, tmp_path / "a", **{**RUN, "attention": "mla"})
    with pytest.raises(ValueError, match=r"attention: expected one of \['gqa', 'mla'\], got 'MLA'"):
        train_drafter(target, dataset, tmp_path / "a", **{**RUN, "attention": "MLA"})
    with pytest.raises(DatasetError, match="dataset directory .* does not exist"):
        train_drafter(target, tmp_path / "missing", tmp_path / "a", **RUN)
    other = tmp_path / "other_vocab"
    shutil.copytree(dataset, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["target"]["vocab_size"] = 512
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match="made for a target with vocab_size 512, this target has 256"):
        train_drafter(target, other, tmp_path / "a", **RUN)


# ----------------------------------------------------------------------------------------------- MLA drafter
# Slow: the MLA run is one more compile of the whole training step (target forward, TTT unroll, gradients, AdamW):
# 25-30 s on 2 cores. The default suite checks the MLA unroll itself against HF (tests/models/test_eagle3_mla.py).
@pytest.fixture(scope="module")
def trained_mla(target, dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("run_mla")
    return train_drafter(target, dataset, out, **RUN_MLA), out


@pytest.mark.slow
def test_mla_drafter_loss_decreases(trained_mla):
    drafter, out = trained_mla
    assert drafter.config.mla is not None and drafter.config.full_vocab and drafter.d2t is None
    log = read_log(out)
    assert [e["step"] for e in log] == list(range(1, STEPS + 1))
    loss = np.array([e["loss"] for e in log])
    assert loss[-4:].mean() < loss[:4].mean() - 0.3, loss


@pytest.mark.slow
def test_mla_ttt_equals_inference_and_hf_reference(target, trained_mla):
    """Step 0 of the MLA drafter's TTT unroll is its own uncached inference forward; every step equals an unroll built
    from HF's DeepseekV3Attention under the training-time-test mask (tests/reference/eagle3_mla.py), loaded from the
    trained drafter's HF export."""
    drafter, out = trained_mla
    J = 3
    ids = np.random.default_rng(2).integers(0, V, (1, T))
    aux = np.asarray(drafter.aux_hidden(ids))
    ttt = np.asarray(ttt_logits(drafter, ids, aux, J))[:, 0]
    first = np.asarray(drafter.logits(aux, np.append(ids[0, 1:], 0)[None]))[0]
    np.testing.assert_allclose(ttt[0], first, atol=2e-5, rtol=0)

    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    embed = np.asarray(target.params["embed"].get_value())
    model = mla_ref.Eagle3MLADrafter(DeepseekV3Config(**raw), target.config.hidden_size, 3, embed).eval()
    tensors = {k: torch.from_numpy(v) for k, v in load_file(out / "model.safetensors").items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    with torch.no_grad():
        want = mla_ref.ttt_logits(model, torch.from_numpy(ids), torch.from_numpy(aux), J)[:, 0].numpy()
    for j in range(J):
        assert rel_err(ttt[j], want[j]) < 1e-4, f"TTT step {j}"
    assert np.abs(ttt[1] - ttt[2]).max() > 1e-2  # the steps differ: a wrong mask or shift would show


@pytest.mark.slow
def test_mla_drafter_checkpoint_and_export_reload_equal(target, dataset, trained_mla, tmp_path):
    """The HF export (Eagle3DeepseekV2ForCausalLM) loads to the same config and weights; resuming the finished run
    restores its last Orbax checkpoint (the attention weights nested under "attn") to the same weights."""
    drafter, out = trained_mla
    want = dict(nnx.to_flat_state(drafter.params))
    assert ("attn", "kv_b_k") in want

    def assert_same(other):
        assert other.config == drafter.config
        got = dict(nnx.to_flat_state(other.params))
        assert got.keys() == want.keys()
        for path, var in got.items():
            np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(want[path].get_value()), str(path))

    assert_same(load_drafter(out, target, dtype=jnp.float32))
    shutil.copytree(out, tmp_path / "run")
    assert_same(train_drafter(target, dataset, tmp_path / "run", **RUN_MLA, resume=True))


# ----------------------------------------------------------------------------------------------- EAGLE 3.1
# Slow for the same reason: one more compile of the training step.
@pytest.mark.slow
def test_eagle31_drafter_trains_and_matches_speculators(target, hf_dir, dataset, tmp_path):
    """An EAGLE 3.1 drafter (fc_norm, norm_output) learns; its speculators export loads in the package with the flags
    set, and the package's forward drafts what our TTT unroll drafts at every step (each step fed the post-norm
    output of the last)."""
    drafter = train_drafter(target, dataset, tmp_path / "run", **RUN_31)
    assert (drafter.config.fc_norm, drafter.config.norm_output, drafter.config.norm_before_fc) == (True, True, False)
    loss = np.array([e["loss"] for e in read_log(tmp_path / "run")])
    assert loss[-4:].mean() < loss[:4].mean() - 0.3, loss
    fc_norm = np.asarray(drafter.params["fc_norm"].get_value())
    assert fc_norm.shape == (3, target.config.hidden_size) and np.abs(fc_norm - 1).max() > 1e-3  # it trained
    assert load_drafter(tmp_path / "run", target, dtype=jnp.float32).config == drafter.config

    save_drafter(drafter, tmp_path / "spec", format="speculators", verifier=str(hf_dir))
    spec_cfg = Eagle3SpeculatorConfig.from_pretrained(tmp_path / "spec")
    assert spec_cfg.fc_norm and spec_cfg.norm_output and not spec_cfg.norm_before_fc
    spec_cfg.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(tmp_path / "spec", config=spec_cfg).eval()
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.from_numpy(np.asarray(target.params["embed"].get_value())))
    ids = np.random.default_rng(6).integers(0, V, (1, T))
    aux = np.asarray(drafter.aux_hidden(ids))
    theirs = ref.draft_logits(model, aux[0], np.append(ids[0, 1:], 0), steps=3)
    ours = np.asarray(ttt_logits(drafter, ids, aux, 3))[:, 0]
    for j in range(3):
        assert rel_err(ours[j], theirs[j]) <= 1e-4, f"step {j}"
