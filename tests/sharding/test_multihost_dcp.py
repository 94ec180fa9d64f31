"""`--dcp 8` over 2 processes x 4 CPU devices (gloo): the bundled pair's cache striped over all 8 devices of a 1x8
mesh that spans both processes (each DCP group's all-gather and all-to-all cross them) gives the tokens of one
process with the unstriped cache (1x8, chain of 3, greedy, four held-out prompts)."""

import json

import pytest

from tests.sharding.test_multihost import RUN_TIMEOUT_S, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT_S + 300)]  # three bundled-pair compiles on 8 devices


def test_two_processes_with_dcp_8_give_the_single_process_tokens(tmp_path):
    single = launch(tmp_path, "single", ["--only", "1x8/chain"])
    pair = launch(tmp_path, "pair", ["--only", "1x8/chain-dcp8"], processes=2)
    try:
        codes = [p.wait(timeout=RUN_TIMEOUT_S) for p in single + pair]
    finally:
        for p in single + pair:
            if p.poll() is None:
                p.kill()
    logs = {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in ("single_0", "pair_0", "pair_1")}
    assert codes == [0, 0, 0], f"worker exit codes {codes}; logs:\n{logs}"
    read = lambda name, i: json.loads((tmp_path / name / f"process_{i}.json").read_text())["tokens"]  # noqa: E731
    want, got = read("single", 0)["1x8/chain"], [read("pair", i)["1x8/chain-dcp8"] for i in range(2)]
    assert got[0] == got[1], "the two processes disagree"
    assert got[0] == want and all(len(t) > 0 for t in want)
