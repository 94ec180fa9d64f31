"""A server's start-up within the process's memory maps (startup.py): the per-program estimate against what a compile
really maps, the defaults under half of Linux's default limit, a configuration that cannot start refused at once, and
the compute dtype chosen by backend and checkpoint, not by how the checkpoint's path is spelled."""

import argparse
import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxspec import bundled
from jaxspec.cli import serve
from jaxspec.cli.args import default_dtype
from jaxspec.decoding import DraftShape
from jaxspec.serving import startup
from jaxspec.serving.engine import Engine, EngineConfig, Request
from jaxspec.serving.plan import Segment
from jaxspec.serving.startup import (
    DEFAULT_MAP_LIMIT,
    SEGMENT_MAPS,
    MapBudget,
    Programs,
    StartupError,
    maps_in_use,
    segment_maps,
)

pytestmark = pytest.mark.skipif(startup.map_limit() is None, reason="memory maps are Linux's (/proc/self/maps)")


EVERY_BATCH = ",".join(map(str, range(1, 33)))  # 32 batch buckets: 128 segment programs, past the limit


def served_config(*flags: str) -> EngineConfig:
    """The EngineConfig `jaxspec serve FLAGS` builds for the bundled pair (its parser, defaults and --num-steps)."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(list(flags))
    args.model, args.drafter = "bundled", "bundled"
    return serve._engine_config(args, *serve._num_steps(args, bundled=True))


def test_a_compile_maps_what_the_estimate_says(pair, without_compilation_cache):
    """Each kind of segment program (plain or chain, static-greedy or per-row) compiled the way the executor compiles
    it maps no more than the estimate for this jaxlib says, and more than half of it (an estimate far above the truth
    would refuse configurations that fit). Compiled after dropping JAX's caches, so nothing is reused from another
    test (nor read from the run's compilation cache)."""
    target, drafter, tokenizer = pair
    cfg = EngineConfig(max_batch=2, max_context=256, draft=DraftShape(4), adaptive=True, batch_buckets=(1,))
    engine = Engine(target, drafter, cfg, stop_ids=tokenizer.stop_ids)
    jax.clear_caches()
    engine.submit(Request([1] * 3, 40))
    engine.step()  # admit and prefill
    measured = {}
    for shape in cfg.shapes:
        for greedy in (True, False):
            before = maps_in_use()
            engine.executor.segment(Segment(1, shape, greedy, cfg.segment_cycles))
            jax.block_until_ready(engine.executor.state)
            measured[(not shape.plain, not greedy)] = maps_in_use() - before
    table = segment_maps()
    for kind, maps in measured.items():
        assert table[kind] / 2 < maps <= table[kind], (kind, measured)


def test_the_defaults_fit_half_the_default_limit():
    """`jaxspec serve` with no flags plans at most half of Linux's default vm.max_map_count (the issue: 48 programs
    and ~65,000 maps, dying 13 minutes in); the defaults are adaptive over plain decoding and the tuned chain."""
    config = served_config()
    programs = Programs.of(config)
    assert config.adaptive and len(config.shapes) == 2
    assert programs.count == 16 and programs.estimated_maps(SEGMENT_MAPS) <= DEFAULT_MAP_LIMIT // 2
    assert programs.estimated_maps() <= DEFAULT_MAP_LIMIT * startup.HEADROOM - 2_000  # jax 0.12 too: it starts


def test_a_configuration_that_cannot_start_is_refused_before_compiling():
    """What would pass the limit is refused by the estimate with a message naming the flags to change and the
    limit; and while compiling, a projection of what the programs so far really took refuses the rest."""
    big = Programs.of(served_config("--max-batch", "32", "--batch-buckets", EVERY_BATCH))
    budget = MapBudget(DEFAULT_MAP_LIMIT, 1_000)
    with pytest.raises(StartupError) as e:
        budget.check(big)
    for words in ("--batch-buckets", "--max-batch", "--max-context", "--num-steps"):
        assert words in str(e.value)
    assert "vm.max_map_count is 65,530" in str(e.value) and f"{big.count} segment programs" in str(e.value)
    small = Programs.of(served_config("--max-batch", "2", "--max-context", "256"))
    assert budget.check(small) == small.estimated_maps()
    budget.check_projection(small, 4, 4 * 1_500)  # 8 programs at 1,500: 12,000 maps, fine
    with pytest.raises(StartupError, match="per program measured"):
        budget.check_projection(small, 2, 2 * 8_000)  # 8 at 8,000: 64,000


def test_serve_refuses_at_once_naming_the_flags():
    """The command line: refused before loading the pair or compiling anything, in seconds."""
    argv = [sys.executable, "-m", "jaxspec", "serve", "--max-batch", "32", "--batch-buckets", EVERY_BATCH]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "vm.max_map_count" in done.stderr and "--batch-buckets" in done.stderr
    assert "loading" not in done.stderr


def test_the_default_dtype_follows_the_backend_and_the_checkpoint(tmp_path):
    """float32 on CPU whatever the path (the bundled pair, or the same checkpoint copied elsewhere); on an
    accelerator the checkpoint's own dtype, bfloat16 when it states another or none; --dtype wins."""
    target_dir, _ = bundled.paths()
    copy = tmp_path / "copy"
    shutil.copytree(target_dir, copy)
    for path in (target_dir, copy, str(copy) + "/"):
        assert default_dtype(None, path, "cpu")[0] == jnp.float32
        assert default_dtype(None, path, "gpu")[0] == jnp.bfloat16  # the checkpoint's: torch_dtype bfloat16
    config = json.loads((copy / "config.json").read_text())
    for saved, expected in (("float32", jnp.float32), ("float16", jnp.bfloat16), (None, jnp.bfloat16)):
        config.pop("dtype", None)
        config["torch_dtype"] = saved
        (copy / "config.json").write_text(json.dumps(config))
        assert default_dtype(None, copy, "tpu")[0] == expected, saved
    assert default_dtype("bfloat16", target_dir, "cpu") == (jnp.bfloat16, "--dtype")
