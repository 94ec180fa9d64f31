"""CLI findings of the issue-18 probe: argument errors are one argparse-style line, found before any model loads;
`--stream` never prints U+FFFD for a character split across chunks; `--devices` picks a subset for the mesh."""

import json
import re
import shutil

import jax
import pytest

import jaxspec
from jaxspec import bundled
from jaxspec.cli import build_parser, main
from jaxspec.cli.args import build_target
from jaxspec.decoding import generate as generate_module
from jaxspec.decoding.generate import GenerateResult


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any attempt to build or load a target fails the test: errors must come first."""

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the argument error was reported")

    monkeypatch.setattr(jaxspec, "load_target", refuse)
    monkeypatch.setattr(jaxspec.Target, "random", refuse)
    monkeypatch.setattr(jaxspec.Target, "abstract", refuse)


@pytest.fixture
def bad_eps_model(hf_checkpoint, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(hf_checkpoint("kimi")[0], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": -1}))
    return path


GEN = ["generate", "--preset", "tiny", "--ids", "--prompt", "1,2"]


@pytest.mark.parametrize(
    "argv, pattern",
    [
        ([*GEN, "--temperature", "-1"], r"--temperature: expected a finite number >= 0"),
        ([*GEN, "--top-p", "0"], r"--top-p: expected a value in \(0, 1\]"),
        ([*GEN, "--top-k", "-2"], r"--top-k: expected an integer >= 0"),
        ([*GEN, "--max-new-tokens", "0"], r"--max-new-tokens: expected an integer >= 1"),
        ([*GEN, "--seed", "-1"], r"--seed: expected an integer in \[0, 2\*\*32\)"),
        ([*GEN, "--num-steps", "40"], r"--num-steps: expected an integer in \[0, 16\]"),
        ([*GEN, "--topk", "0"], r"--topk: expected an integer in \[1, 16\]"),
        (
            [*GEN, "--topk", "2", "--num-steps", "2", "--num-draft-tokens", "9"],
            r"--num-draft-tokens: expected an integer in \[2, 7\]",
        ),
        ([*GEN, "--num-steps", "2", "--num-draft-tokens", "5"], r"a chain \(--topk=1\) verifies --num-steps \+ 1"),
        ([*GEN, "--mesh", "8"], r"--mesh: mesh shape: expected 'DATAxMODEL'"),
        ([*GEN, "--devices", "a-b"], r"--devices: expected a count"),
        (["generate", "--preset", "nope", "--ids", "--prompt", "1"], r"--preset: unknown preset 'nope'"),
        (["generate", "--preset", "tiny", "--ids", "--prompt", "1,x"], r"--ids --prompt: expected comma-separated"),
        (["generate", "--model", "/nonexistent", "--prompt", "hi"], r"--model: /nonexistent is not a directory"),
        (["predict", "--preset", "tiny", "--top", "0"], r"--top: expected an integer >= 1"),
        (["inspect", "--preset", "tiny", "--cache-len", "0"], r"--cache-len: expected an integer >= 1"),
        (["--collective-preset", "fast", "predict"], r"unknown collective preset 'fast'"),
    ],
)
def test_argument_errors_are_one_line_before_loading(no_model_loads, argv, pattern):
    with pytest.raises(SystemExit) as err:
        main(argv)
    msg = str(err.value.code)
    assert "\n" not in msg and msg.startswith("jaxspec ") and ": error: " in msg
    assert re.search(pattern, msg), msg


def test_generate_with_model_and_no_drafter_fails_before_loading(no_model_loads, hf_checkpoint):
    with pytest.raises(SystemExit, match=r"--num-steps > 0 with --model needs --drafter"):
        main(["generate", "--model", str(hf_checkpoint("kimi")[0]), "--ids", "--prompt", "1,2"])


def test_bad_config_file_is_one_line(bad_eps_model):
    with pytest.raises(SystemExit) as err:
        main(["predict", "--model", str(bad_eps_model), "--prompt", "1,2"])
    assert str(err.value.code) == "jaxspec predict: error: rms_norm_eps: expected a positive finite number, got -1.0"


def test_mesh_subset_with_devices():
    args = build_parser().parse_args(["inspect", "--preset", "tiny", "--devices", "4-5", "--mesh", "1x2"])
    target, _ = build_target(args, abstract=True)
    assert target.mesh.devices.ravel().tolist() == jax.devices()[4:6]
    with pytest.raises(SystemExit, match=r"needs 4 devices, 8 available; .*--devices 4"):
        build_target(build_parser().parse_args(["inspect", "--preset", "tiny", "--mesh", "1x4"]), abstract=True)


def test_stream_holds_back_a_character_split_across_chunks(monkeypatch, capsys):
    """The byte tokenizer of the bundled pair spells 'é' and '€' as 2 and 3 tokens; chunks split them."""
    from jaxspec.tokenizer import load_tokenizer

    tok_dir = bundled.paths()[0]
    ids = load_tokenizer(tok_dir).encode("né€!")
    assert len(ids) == 7  # n, é (2 bytes), € (3 bytes), !

    def fake_generate(target, drafter, prompts, *, on_cycles=None, tokenizer=None, **kwargs):
        for cut in (2, 4, 5, 7):  # every boundary but the last falls inside a character
            on_cycles([ids[:cut]])
        return GenerateResult([ids], [tokenizer.decode(ids)], {})

    monkeypatch.setattr(generate_module, "generate", fake_generate)
    monkeypatch.setattr(jaxspec.Target, "random", jaxspec.Target.abstract)  # the fake never runs the target
    argv = ["generate", "--preset", "tiny", "--num-steps", "0", "--tokenizer", str(tok_dir), "--prompt", "hi"]
    assert main([*argv, "--stream"]) == 0
    out = capsys.readouterr().out
    assert "\ufffd" not in out and out == "né€!\n"
