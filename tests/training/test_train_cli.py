"""`jaxspec train-drafter` arguments: every bad input is refused with a clear message before weights are loaded; the
full command (slow) generates data from text prompts, trains, exports a loadable drafter and resumes."""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import pytest

from jaxspec.cli import train_drafter as train_cli
from tests.reference.hf_tiny import hf_config, save_hf_model


def run(*argv) -> int:
    parser = argparse.ArgumentParser(prog="jaxspec train-drafter")
    train_cli.add_arguments(parser)
    return train_cli.run(parser.parse_args([str(a) for a in argv]))


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """A target directory with only config.json: enough for every check that runs before the weights load."""
    path = tmp_path_factory.mktemp("config_only")
    hf_config("kimi").save_pretrained(path)  # vocab 256, 3 layers
    return path


def fake_dataset(path, vocab_size=256, complete=True):
    path.mkdir()
    manifest = {
        "format": "jaxspec-drafter-data",
        "version": 1,
        "complete": complete,
        "target": {"vocab_size": vocab_size},
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_bad_arguments(config_dir, tmp_path):
    out = tmp_path / "out"
    data = fake_dataset(tmp_path / "data")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\n{"text": "hi"}\n')
    (tmp_path / "bad_ids.txt").write_text("1,2,3\n4,x\n")
    (tmp_path / "big_ids.txt").write_text("1,2,999\n")
    (tmp_path / "text.txt").write_text("hello there\n")
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "done" / "train_config.json").parent.mkdir()
    (tmp_path / "done" / "train_config.json").write_text("{}")
    base = ["--target", config_dir, "--out", out]
    cases = [
        (["--target", tmp_path / "nope", "--out", out, "--data", data], r"--target: .*nope is not a directory"),
        (["--target", tmp_path, "--out", out, "--data", data], r"--target: config.json not found"),
        (base, r"give --prompts FILE \(generate the data\) or --data DIR"),
        ([*base, "--data", data, "--draft-vocab", 300], r"--draft-vocab: 300 must be in \[1, 256\]"),
        ([*base, "--data", data, "--steps", 0], r"--steps: expected a positive integer, got 0"),
        ([*base, "--data", data, "--capture-layers", "0,5"], r"--capture-layers: \[0, 5\] must be layer outputs in"),
        ([*base, "--data", data, "--capture-layers", "a"], r"--capture-layers: expected comma-separated integers"),
        ([*base, "--data", tmp_path / "missing"], r"--data: dataset directory .*missing does not exist"),
        ([*base, "--data", fake_dataset(tmp_path / "v512", 512)], r"vocabulary of 512 tokens, the target has 256"),
        ([*base, "--data", fake_dataset(tmp_path / "partial", complete=False)], r"generation was interrupted"),
        ([*base, "--prompts", tmp_path / "none.txt"], r"--prompts: .*none.txt is not a file"),
        ([*base, "--prompts", tmp_path / "empty.txt"], r"holds no prompts"),
        ([*base, "--prompts", tmp_path / "bad.jsonl"], r'bad.jsonl:2: expected \{"prompt": "text"\} or \{"ids"'),
        ([*base, "--prompts", tmp_path / "bad_ids.txt", "--ids"], r"bad_ids.txt:2: expected comma-separated token"),
        ([*base, "--prompts", tmp_path / "big_ids.txt", "--ids"], r"prompt 1 has token ids outside \[0, 256\)"),
        ([*base, "--prompts", tmp_path / "text.txt"], r"text prompts need a tokenizer: .*no tokenizer found"),
        (["--target", config_dir, "--out", tmp_path / "done", "--data", data], r"earlier training run; pass --resume"),
    ]
    for argv, match in cases:
        with pytest.raises(SystemExit, match=match):
            run(*argv)


def test_bad_attention_arguments(tmp_path, capsys):
    """An unknown --attention is an argparse error; an MLA drafter for a target without a query LoRA is refused
    before its weights load."""
    no_q_lora = tmp_path / "no_q_lora"
    hf_config("kimi", q_lora_rank=None).save_pretrained(no_q_lora)
    base = ["--target", no_q_lora, "--out", tmp_path / "out", "--data", fake_dataset(tmp_path / "data")]
    with pytest.raises(SystemExit, match="--attention mla: an MLA drafter needs a query LoRA"):
        run(*base, "--attention", "mla")
    with pytest.raises(SystemExit):
        run(*base, "--attention", "gqa2")
    assert "argument --attention: invalid choice: 'gqa2' (choose from" in capsys.readouterr().err


def test_training_flags_are_the_train_config_fields(tmp_path):
    """Every TrainConfig field has a flag (and nothing else lands in it): a command line setting each of them to a
    value other than its default gives exactly that TrainConfig; no flags give the defaults."""
    from jaxspec.training import TrainConfig

    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    base = ["--target", str(tmp_path), "--out", str(tmp_path / "out")]
    assert train_cli.train_config(parser.parse_args(base)) == TrainConfig()
    flags = ["--draft-vocab", "100", "--ttt-depth", "2", "--steps", "7", "--batch-size", "4", "--seq-len", "64"]
    flags += ["--lr", "0.003", "--warmup", "2", "--weight-decay", "0.1", "--clip", "1.5", "--seed", "9", "--heads", "4"]
    flags += ["--kv-heads", "2", "--intermediate-size", "48", "--capture-layers", "0,2", "--attention", "mla"]
    flags += ["--variant", "eagle3.1"]
    expected = TrainConfig(
        draft_vocab_size=100,
        ttt_depth=2,
        steps=7,
        batch_size=4,
        seq_len=64,
        lr=0.003,
        warmup=2,
        weight_decay=0.1,
        clip=1.5,
        seed=9,
        heads=4,
        kv_heads=2,
        intermediate_size=48,
        capture_layers=(0, 2),
        attention="mla",
        variant="eagle3.1",
    )
    assert {f for f in TrainConfig.__dataclass_fields__ if getattr(expected, f) == getattr(TrainConfig(), f)} == set()
    assert train_cli.train_config(parser.parse_args([*base, *flags])) == expected


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_train_drafter_command_end_to_end(tmp_path, capsys, attention):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from jaxspec.io import load_drafter, load_target

    target_dir = tmp_path / "target"
    save_hf_model("kimi", target_dir)
    words = ["[UNK]", "[EOS]", *"the quick brown fox jumps over a lazy dog and runs far away".split()]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(target_dir / "tokenizer.json"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["the quick fox", "a lazy dog runs"] * 4))
    out = tmp_path / "out"
    argv = ["--target", target_dir, "--prompts", prompts, "--out", out, "--dtype", "float32", "--draft-vocab", 32]
    argv += ["--max-new-tokens", 6, "--batch-size", 4, "--heads", 4, "--lr", 1e-3, "--warmup", 1]
    argv += ["--attention", "mla"] if attention == "mla" else ["--kv-heads", 2]
    assert run(*argv, "--steps", 3, "--checkpoint-every", 2) == 0
    printed = capsys.readouterr().out
    assert "step 3: loss" in printed and f"written to {out}" in printed
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["num_sequences"] == 8
    drafter = load_drafter(out, load_target(target_dir, dtype=jnp.float32), dtype=jnp.float32)
    assert drafter.config.draft_vocab_size == 32 and drafter.config.num_attention_heads == 4
    assert (drafter.config.mla is not None) == (attention == "mla")
    assert len((out / "train_log.jsonl").read_text().splitlines()) == 3
    # --resume of a finished run exports again; changed settings are refused.
    assert run(*argv, "--steps", 3, "--resume") == 0
    with pytest.raises(SystemExit, match=r"cannot resume, the run's settings changed: steps \(3 -> 5\)"):
        run(*argv, "--steps", 5, "--resume")
