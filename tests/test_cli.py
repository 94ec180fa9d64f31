"""The `jaxspec` command, run in-process (the backend already has the 8 simulated devices)."""

import json
import re
from pathlib import Path

import pytest

from jaxspec.cli import build_parser, main
from jaxspec.cli import generate as generate_cli
from jaxspec.decoding import DraftShape


def test_predict_prints_candidates_per_position(capsys):
    assert main(["predict", "--preset", "tiny", "--mesh", "1x8", "--prompt", "3,4,5", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "preset 'tiny' (random weights): 3 layers" in out
    assert "{'data': 1, 'model': 8}" in out
    assert sum(line.startswith("after [") for line in out.splitlines()) == 3


def test_predict_bad_prompt():
    with pytest.raises(SystemExit, match="comma-separated integers"):
        main(["predict", "--preset", "tiny", "--prompt", "a,b"])


def test_inspect_counts_collectives_of_a_verify_step(tmp_path, capsys):
    out = tmp_path / "inspect.json"
    args = ["inspect", "--preset", "tiny", "--mesh", "2x4", "--batch", "2", "--tokens", "4", "--cache-len", "32"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["collectives"]["all-reduce"]["executed"] == 2 * 3 + 1  # 2 per layer + the embedding
    assert report["mesh"] == {"data": 2, "model": 4}
    assert report["collective_preset"]["name"] == "default"
    assert "all-reduce" in capsys.readouterr().out


def test_inspect_find_dcp_needs_a_slice_and_dcp_must_divide_the_model_axis():
    with pytest.raises(SystemExit, match="--find-dcp needs --topology"):
        main(["inspect", "--preset", "tiny", "--find-dcp"])
    with pytest.raises(SystemExit, match=r"--dcp: dcp: 3 does not divide the mesh's 'model' axis of 8"):
        main(["inspect", "--preset", "tiny", "--mesh", "1x8", "--dcp", "3"])


def test_unknown_collective_preset():
    with pytest.raises(SystemExit, match="unknown collective preset 'fast'"):
        main(["--collective-preset", "fast", "predict"])


@pytest.mark.slow  # test budget (the default suite reached 31 minutes): ~20 s; trees: tests/decoding
def test_generate_tree_with_ids_and_stats(capsys):
    argv = ["generate", "--preset", "tiny", "--ids", "--prompt", "1,2,3", "--prompt", "7,8", "--topk", "2"]
    assert main([*argv, "--num-steps", "2", "--num-draft-tokens", "4", "--max-new-tokens", "6", "--stats"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[0] ") and "\n[1] " in out
    assert "num_steps 2, topk 2, 4 draft tokens" in out
    assert "draft depth 2: reached" in out and "mean accepted length" in out


def test_generate_text_prompt_needs_a_tokenizer():
    with pytest.raises(SystemExit, match="need --tokenizer"):
        main(["generate", "--preset", "tiny", "--prompt", "hello"])


def _resolved(argv: list[str]) -> DraftShape:
    """The draft shape `jaxspec generate argv` runs, resolved as main() resolves it (before anything loads)."""
    args = build_parser().parse_args(argv)
    generate_cli.check(args)
    return args.draft


def test_generate_num_steps_auto_reads_the_tuning_result(tmp_path):
    # What generate then runs with a chain or a tree: test_generate_tree_with_ids_and_stats and the bundled pair's run.
    (tmp_path / "tune.json").write_text(json.dumps({"recommended_k": 2}))
    argv = ["generate", "--preset", "tiny", "--ids", "--prompt", "1,2,3", "--max-new-tokens", "4", "--stats"]
    assert _resolved([*argv, "--num-steps", "auto", "--tune", str(tmp_path)]) == DraftShape(2)
    with pytest.raises(SystemExit, match="needs --tune DIR"):
        main([*argv, "--num-steps", "auto", "--tune", str(tmp_path / "missing")])
    bad = {"num_steps": 2, "topk": 1, "num_draft_tokens": 9}  # a chain of 2 verifies 3 tokens
    (tmp_path / "tune.json").write_text(json.dumps({"recommended": bad}))
    with pytest.raises(SystemExit, match="unreadable: num_draft_tokens: a chain"):
        main([*argv, "--num-steps", "auto", "--tune", str(tmp_path)])


def test_generate_num_steps_auto_takes_a_recommended_tree(tmp_path):
    tree = {"num_steps": 2, "topk": 2, "num_draft_tokens": 4, "label": "2x2/4"}
    (tmp_path / "tune.json").write_text(json.dumps({"recommended": tree, "recommended_k": 1}))
    argv = ["generate", "--preset", "tiny", "--ids", "--prompt", "1,2,3", "--max-new-tokens", "4", "--stats"]
    assert _resolved([*argv, "--num-steps", "auto", "--tune", str(tmp_path)]) == DraftShape(2, 2, 4)
    # An explicit --topk wins over the tuning result's tree (the depth still comes from it).
    assert _resolved([*argv, "--num-steps", "auto", "--tune", str(tmp_path), "--topk", "3"]) == DraftShape(2, 3, 13)


def test_serve_tree_flags_reach_the_engine_config_and_are_checked_before_loading():
    # DraftShape's messages, in flag names (cli/args.draft_shape)
    with pytest.raises(SystemExit, match="--topk=2 drafts a tree: it needs --num-steps >= 1"):
        main(["serve", "--num-steps", "0", "--topk", "2"])
    with pytest.raises(SystemExit, match=r"--num-draft-tokens: expected an integer in \[2, 7\]"):
        main(["serve", "--num-steps", "2", "--topk", "2", "--num-draft-tokens", "9"])


def test_serve_num_steps_auto_is_adaptive_over_plain_and_the_recommended_chain(tmp_path):
    """`serve --num-steps auto` (its default): adaptive, the chain's depth from tune.json (the bundled pair's committed
    one: 4), 3 without one, plain decoding alone without a drafter; with --topk a tree of that depth (the engine's
    candidates: plain decoding and the tree), its prior the tree's own recorded acceptance."""
    import argparse

    from jaxspec.cli.serve import _engine_config, _num_steps, _recorded_acceptance

    args = lambda **kw: argparse.Namespace(**({"num_steps": "auto", "topk": 1, "drafter": "d", "tune": None} | kw))
    assert _num_steps(args(), bundled=True) == (4, True)
    assert _num_steps(args(), bundled=False) == (3, True)
    assert _num_steps(args(drafter=None), bundled=False) == (0, False)
    assert _num_steps(args(num_steps="2"), bundled=True) == (2, False)
    with pytest.raises(SystemExit, match="not found"):
        _num_steps(args(tune=tmp_path), bundled=True)
    assert _num_steps(args(topk=2), bundled=True) == (4, True)
    flags = build_parser().parse_args(["serve", "--topk", "2", "--num-draft-tokens", "8"])
    tree = DraftShape(4, 2, 8)
    assert _engine_config(flags, 4, True).shapes == (DraftShape(0), tree)
    trees = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "tune_bundled_trees" / "tune.json"
    assert _recorded_acceptance(trees, DraftShape(3, 2, 5)) == pytest.approx([0.9286, 0.9111, 0.4987], abs=1e-4)
    assert len(_recorded_acceptance(trees, tree)) == 4
    assert _recorded_acceptance(trees, DraftShape(4, 3, 8)) is None  # not measured: the tree runs a segment first
    assert len(_recorded_acceptance(trees)) == len(_recorded_acceptance(trees, DraftShape(4))) > 0  # the chains'


def test_train_drafter_is_a_subcommand_and_checks_its_input(tmp_path):
    with pytest.raises(SystemExit, match="--target: .* is not a directory"):
        main(["train-drafter", "--target", str(tmp_path / "missing"), "--out", str(tmp_path / "out")])


def test_generate_without_flags_runs_the_bundled_pair_and_reports_the_speedup(capsys):
    assert main(["generate", "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "held-out prompt" in out and "mean accepted length" in out
    assert re.search(r"speedup \d+\.\d\dx", out), out


class _Loaded(Exception):
    """Raised by a stand-in load_target: what it was asked for, before anything loads."""


def test_int4_experts_reaches_load_target_for_generate_and_serve(monkeypatch):
    """--int4-experts (generate and serve): auto loads the bundled pair's INT4 experts dense on this CPU, packed keeps
    them 4-bit; an unknown value is refused by argparse, naming the flag."""
    import jaxspec
    import jaxspec.io

    def load_target(path, **kw):
        raise _Loaded(kw["dequantize_int4"])

    monkeypatch.setattr(jaxspec, "load_target", load_target)
    monkeypatch.setattr(jaxspec.io, "load_target", load_target)
    from jaxspec import bundled

    generate = ["generate", "--model", str(bundled.paths()[0]), "--num-steps", "0", "--prompt", "x"]
    for flags, dense in (([], True), (["--int4-experts", "packed"], False), (["--int4-experts", "dense"], True)):
        for command in (generate, ["serve", "--num-steps", "0"]):
            with pytest.raises(_Loaded) as loaded:
                main(command + flags)
            assert loaded.value.args == (dense,), (command, flags)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--int4-experts", "int8"])
