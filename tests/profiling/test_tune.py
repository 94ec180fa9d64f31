"""The tuner end to end on the tiny target with a random drafter (acceptance ~0, so plain decoding should win)."""

import argparse
import json

import jax
import jax.numpy as jnp
import pytest

from jaxspec import KimiConfig, Target
from jaxspec.profiling.tune import TABLE_COLUMNS, add_tune_arguments, cmd_tune, format_table, read_prompts, tune
from sharding.mesh import make_mesh
from tests.decoding.drafters import random_drafter

PROMPTS = [[1, 17, 42, 7, 99], [5, 8, 13, 21, 34, 55]]
FAST = dict(max_new_tokens=32, stream_cycles=8, reps=2, inner=2, repeats=1, verbose=False)
ROW_FIELDS = {"k", "draft_tokens", "verify_ms", "cycle_ms", "E", "predicted_tok_s", "measured_tok_s", "gap"}

try:
    import matplotlib  # noqa: F401

    HAVE_MPL = True
except ImportError:
    HAVE_MPL = False


@pytest.fixture(scope="module")
def target():
    return Target.random(KimiConfig.preset("tiny"), dtype=jnp.float32)


def _check_report(report, ks, mesh):
    assert [r["k"] for r in report["rows"]] == list(ks)
    for row in report["rows"]:
        assert ROW_FIELDS <= set(row)
        assert (row["gap_explanation"] is None) == (abs(row["gap"]) <= report["gap_tolerance"])
        assert row["E"] < 1.3  # a random drafter is almost never right
    predicted = [r["predicted_tok_s"] for r in report["rows"]]
    assert report["recommended_k"] == ks[predicted.index(max(predicted))]
    # (Which k wins depends on measured timings, which move by >10% on a shared CPU: not asserted here.)
    assert report["measured_best_k"] in ks
    assert len(report["acceptance"]["rate"]) == max(ks) and report["acceptance"]["rate"][0] < 0.3
    assert report["mesh"] == mesh
    assert set(report["versions"]) >= {"jax", "jaxlib"} and report["versions"]["jax"] == jax.__version__


@pytest.mark.parametrize("ks", [(0, 1), pytest.param((0, 1, 2, 3), marks=pytest.mark.slow)])
def test_tune_one_device(target, tmp_path, ks):
    report = tune(target, random_drafter(target), PROMPTS, ks, output_dir=tmp_path, **FAST)
    _check_report(report, ks, {"data": 1, "model": 1})
    saved = json.loads((tmp_path / "tune.json").read_text())
    assert saved["recommended_k"] == report["recommended_k"] and len(saved["rows"]) == len(ks)
    assert saved["collective_preset"] is None
    if HAVE_MPL:
        assert (tmp_path / "tune.png").stat().st_size > 0 and report["plot"] == str(tmp_path / "tune.png")
    table = format_table(report)
    assert table.splitlines()[0] == " | ".join(TABLE_COLUMNS) and "recommended k" in table


def test_tune_on_8_devices(target):
    mesh_target = target.on_mesh(make_mesh("1x8"))
    ks = (1,)  # compiles dominate this test's time; k = 0 on 1 device is covered above
    report = tune(mesh_target, random_drafter(mesh_target), PROMPTS, ks, collective_preset="cpu-sim", **FAST)
    _check_report(report, ks, {"data": 1, "model": 8})
    assert report["collective_preset"] == "cpu-sim"


def test_tune_rejects_bad_sweeps(target):
    with pytest.raises(ValueError, match="drafter"):
        tune(target, None, PROMPTS, (0, 1), **FAST)
    with pytest.raises(ValueError, match="non-negative"):
        tune(target, None, PROMPTS, (-1, 0), **FAST)


def test_cli_arguments_and_prompts_file(tmp_path):
    p = argparse.ArgumentParser()
    add_tune_arguments(p)
    args = p.parse_args(["--preset", "tiny", "--max-k", "3", "--output", str(tmp_path)])
    assert (args.preset, args.max_k, args.drafter, args.output) == ("tiny", 3, None, tmp_path)
    good = tmp_path / "prompts.txt"
    good.write_text("1,2,3\n\n4, 5\n")
    assert read_prompts(good) == [[1, 2, 3], [4, 5]]
    bad = tmp_path / "bad.txt"
    bad.write_text("1,2\nhello\n")
    with pytest.raises(ValueError, match="bad.txt:2"):
        read_prompts(bad)
    with pytest.raises(SystemExit, match="--drafter"):
        cmd_tune(p.parse_args(["--model", str(tmp_path)]))
    with pytest.raises(SystemExit, match="prompts-file"):
        cmd_tune(p.parse_args(["--preset", "tiny", "--prompts-file", str(bad)]))
