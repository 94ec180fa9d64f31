"""2 processes x 4 CPU devices (gloo) against 1 process x 8: the same tokens, and a lost process ends the other.

Every process is a `tests.sharding.multihost_worker` launch; all of them start at once (the kill pairs mostly wait,
so they overlap the compiles): the reference (1 x 8), the pair that runs every case (bundled pair loaded once per
mesh, 1x8 and 4x2, greedy plain / chain / tree and seeded sampling, plus a `jaxspec-convert` output restored across
both), and two pairs that run an all-reduce until one of their processes is killed with SIGKILL.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sharding.multihost_worker import CASES, MESHES

ROOT = Path(__file__).resolve().parents[2]
# Both topologies compile with the same flags, so the comparison is like for like; these halve XLA:CPU's compile time.
ENV = {"PJRT_NPROC": "32", "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"}
KILL_HEARTBEAT_S = 30  # the kill pairs' heartbeat timeout
LOST_WITHIN_S = 120  # the bound: a lost peer ends the others within 2 minutes
RUN_TIMEOUT_S = 900
# The launches share the machine's cores: ~2 minutes on 2 idle cores, far longer when other work shares them.
pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, name: str, extra: list[str], processes: int = 1, heartbeat: int = 60) -> list[subprocess.Popen]:
    """Start `processes` workers (with a coordinator on a free port when more than one); logs in out/name_I.log."""
    env = os.environ | ENV | {"PYTHONPATH": str(ROOT)}
    join = ["--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", str(processes)] if processes > 1 else []
    procs = []
    for i in range(processes):
        cmd = [sys.executable, "-m", "tests.sharding.multihost_worker", str(out / name), *extra, *join]
        cmd += ["--process-id", str(i), "--heartbeat", str(heartbeat)]
        log = open(out / f"{name}_{i}.log", "w")  # noqa: SIM115 (closed with the process, below)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    return procs


def wait_for(path: Path, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise AssertionError(f"{path.name} never appeared (exit codes {[p.poll() for p in procs]})")
        time.sleep(0.2)


def kill_and_time(out: Path, name: str, procs: list[subprocess.Popen], victim: int) -> dict:
    """SIGKILL process `victim` once both are running collectives; how the survivor ended, and how soon."""
    for i in range(len(procs)):
        wait_for(out / name / f"ready_{i}", procs, RUN_TIMEOUT_S)
    survivor = procs[1 - victim]
    alive = survivor.poll() is None
    procs[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    try:
        code = survivor.wait(timeout=LOST_WITHIN_S + 60)
    except subprocess.TimeoutExpired:
        survivor.kill()
        code = None
    log = (out / f"{name}_{1 - victim}.log").read_text()
    return {"alive_at_kill": alive, "code": code, "seconds": time.monotonic() - killed, "log": log}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from converters.target import convert_target
    from jaxspec import bundled

    out = tmp_path_factory.mktemp("multihost")
    orbax = out / "orbax"
    convert_target(bundled.paths()[0], orbax, dtype="float32", progress=False)
    single = launch(out, "single", [])  # the restored target is compared with its 1x8/chain
    pair = launch(out, "pair", ["--orbax", str(orbax)], processes=2)
    kill_1 = launch(out, "kill1", ["--hang"], processes=2, heartbeat=KILL_HEARTBEAT_S)
    kill_0 = launch(out, "kill0", ["--hang"], processes=2, heartbeat=KILL_HEARTBEAT_S)
    try:
        lost = {1: kill_and_time(out, "kill1", kill_1, victim=1), 0: kill_and_time(out, "kill0", kill_0, victim=0)}
        codes = [p.wait(timeout=RUN_TIMEOUT_S) for p in single + pair]
    finally:
        for p in single + pair + kill_1 + kill_0:
            if p.poll() is None:
                p.kill()
    logs = {n: (out / f"{n}.log").read_text()[-3000:] for n in ("single_0", "pair_0", "pair_1")}
    assert codes == [0, 0, 0], f"worker exit codes {codes}; logs:\n{logs}"
    tokens = {
        name: json.loads((out / name.split("_")[0] / f"process_{name[-1]}.json").read_text())["tokens"]
        for name in ("single_0", "pair_0", "pair_1")
    }
    return tokens, lost


@pytest.mark.slow  # the 2-process runs (~120 s; test budget): test_multihost_serve keeps 2 processes by default
@pytest.mark.parametrize("case", [f"{m}/{c}" for m in MESHES for c in CASES])
def test_two_processes_give_the_single_process_tokens(runs, case):
    tokens, _ = runs
    assert tokens["pair_0"][case] == tokens["pair_1"][case], "the two processes disagree"
    assert tokens["pair_0"][case] == tokens["single_0"][case]
    assert all(len(t) > 0 for t in tokens["single_0"][case])


@pytest.mark.slow  # the 2-process runs (~120 s; test budget): test_multihost_serve keeps 2 processes by default
def test_orbax_restore_gives_the_hf_load_tokens(runs):
    tokens, _ = runs
    assert tokens["pair_0"]["1x8/orbax-chain"] == tokens["pair_1"]["1x8/orbax-chain"], "the two processes disagree"
    assert tokens["pair_0"]["1x8/orbax-chain"] == tokens["single_0"]["1x8/chain"]


@pytest.mark.slow  # the 2-process runs (~120 s; test budget): test_multihost_serve keeps 2 processes by default
@pytest.mark.parametrize("victim", [1, 0])
def test_kill_9_ends_the_other_process_within_2_minutes(runs, victim):
    _, lost = runs
    r = lost[victim]
    assert r["alive_at_kill"], f"the survivor ended before the kill:\n{r['log'][-2000:]}"
    assert r["code"] not in (0, None), f"survivor exit code {r['code']}:\n{r['log'][-2000:]}"
    assert r["seconds"] < LOST_WITHIN_S, f"the survivor took {r['seconds']:.0f} s to end"
    if victim == 1:  # the coordination service (in process 0) names the task that stopped answering
        assert "unhealthy" in r["log"] and "\n1\n" in r["log"], r["log"][-2000:]


def test_one_process_helpers_are_device_put_and_asarray():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sharding.mesh import make_mesh
    from sharding.multihost import is_leader, put_global, to_host, zeros

    mesh = make_mesh("2x4")
    host = {"x": np.arange(32, dtype=np.float32).reshape(8, 4), "key": jax.random.key(3)}
    placed = put_global(host, NamedSharding(mesh, P()))
    np.testing.assert_array_equal(to_host(placed["x"]), host["x"])
    assert jax.random.key_data(placed["key"]).tolist() == jax.random.key_data(host["key"]).tolist()
    split = put_global(host["x"], NamedSharding(mesh, P("data", "model")))
    assert split.sharding.spec == P("data", "model") and split.addressable_shards[0].data.shape == (4, 1)
    np.testing.assert_array_equal(to_host(split), host["x"])
    z = zeros((4, 8), jnp.bfloat16, NamedSharding(mesh, P(None, "model")))
    assert z.dtype == jnp.bfloat16 and z.sharding.spec == P(None, "model") and not to_host(z).any()
    assert is_leader()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--coordinator", "h:1", "generate"], "give --coordinator, --num-processes and --process-id together"),
        (["--coordinator", "h", "--num-processes", "2", "--process-id", "0", "generate"], "expected HOST:PORT"),
        (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2", "predict"], "expected 0..1"),
        (["--distributed", "--process-id", "0", "generate"], "--distributed reads the cluster from the environment"),
        (["--distributed", "train-drafter", "--target", "t", "--out", "o"], "runs as one process only"),
        (["--distributed", "tune", "--presets", "default", "--output", "x"], "--presets re-runs tune"),
    ],
)
def test_bad_distributed_flags_are_one_usage_line(argv, message):
    from jaxspec.cli import main

    with pytest.raises(SystemExit, match=re.escape(message)):
        main(argv)
