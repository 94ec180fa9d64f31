"""benchmarks/serve_vs_vllm.py's verdict: a level is judged over all its rounds and over the rounds both servers
batched (a server whose tokens/s at c > 1 is at most BATCHED x its own c = 1 rate that round did not batch)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # its sibling imports
import serve_vs_vllm  # noqa: E402


def rows(rates: dict) -> list[dict]:
    """Rows as measure() writes them from {(server, c): [tok/s per round]} (1 second per level and round)."""
    return [
        {"server": n, "concurrency": c, "round": i, "tok_s": r, "tokens": r, "seconds": 1.0}
        for (n, c), per_round in rates.items()
        for i, r in enumerate(per_round)
    ]


def test_a_round_a_server_did_not_batch_is_left_out_of_the_batched_ratio():
    # the recorded 2026-12-07 run: vLLM's round 1 at c = 4 was its c = 1 rate
    rates = {
        ("vllm", 1): [579, 589, 557],
        ("jaxspec", 1): [971, 928, 930],
        ("vllm", 4): [1523, 595, 1050],
        ("jaxspec", 4): [1653, 1487, 1623],
    }
    got = serve_vs_vllm.batched(rows(rates), 4)
    assert got["rounds"] == [0, 2]
    assert got["jaxspec_over_vllm"] == pytest.approx((1653 + 1623) / (1523 + 1050))
    level = {"concurrency": 4, "jaxspec_over_vllm": sum(rates["jaxspec", 4]) / sum(rates["vllm", 4]), "batched": got}
    assert level["jaxspec_over_vllm"] > serve_vs_vllm.GOAL > min(serve_vs_vllm.ratios(level))  # 1.74x, but 1.32x
    assert serve_vs_vllm.batched(rows(rates), 1) == {"rounds": [0, 1, 2], "jaxspec_over_vllm": None}


def test_every_round_batched_judges_the_level_as_a_whole():
    rates = {("vllm", 1): [500, 500], ("jaxspec", 1): [800, 800]}
    rates |= {("vllm", 4): [900, 1000], ("jaxspec", 4): [1500, 1400]}
    got = serve_vs_vllm.batched(rows(rates), 4)
    assert got["rounds"] == [0, 1] and got["jaxspec_over_vllm"] == pytest.approx(2900 / 1900)
    none = {**rates, ("vllm", 4): [520, 530]}  # vLLM batched in no round
    assert serve_vs_vllm.batched(rows(none), 4) == {"rounds": [], "jaxspec_over_vllm": None}


class FakeServer:
    """A process group whose CPU seconds grow `busy` per second until `quiet_after`, then stay; a fake clock."""

    def __init__(self, busy: float, quiet_after: float):
        self.now, self.busy, self.quiet_after = 0.0, busy, quiet_after

    def cpu(self, _pgid: int) -> float:
        return self.busy * min(self.now, self.quiet_after)

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def waited(self) -> float:
        """The seconds `wait_quiet` waits for this server (on its clock)."""
        return serve_vs_vllm.wait_quiet(1, cpu=self.cpu, sleep=self.sleep, clock=lambda: self.now)


def test_a_level_waits_until_the_other_server_is_idle():
    # vLLM's process group went on taking ~0.9 CPU seconds after its levels: a level started then shared the cores
    server = FakeServer(busy=0.9, quiet_after=1.2)
    assert server.quiet_after < server.waited() <= server.quiet_after + 2 * serve_vs_vllm.QUIET_WINDOW
    assert FakeServer(busy=0.9, quiet_after=0.0).waited() == pytest.approx(serve_vs_vllm.QUIET_WINDOW)
    below = FakeServer(busy=serve_vs_vllm.QUIET_SHARE / 2, quiet_after=1e9)  # busy, but under the idle share
    assert below.waited() == pytest.approx(serve_vs_vllm.QUIET_WINDOW)


def test_a_server_that_never_goes_idle_is_waited_for_at_most_the_timeout():
    waited = FakeServer(busy=1.0, quiet_after=1e9).waited()
    assert serve_vs_vllm.QUIET_TIMEOUT <= waited < serve_vs_vllm.QUIET_TIMEOUT + serve_vs_vllm.QUIET_WINDOW + 1e-9


def test_servers_start_without_the_test_suites_simulated_mesh_setting(monkeypatch, tmp_path):
    # .ci/run and tests/conftest.py export PJRT_NPROC=32 for simulated meshes; a user's `jaxspec serve` has none, and a
    # one-device server inheriting it ran XLA:CPU with 32 pool threads on 2 cores
    import serve_load

    monkeypatch.setenv("PJRT_NPROC", "32")
    monkeypatch.setenv("JAXSPEC_SOMETHING_ELSE", "kept")
    env = serve_load.server_env({"VLLM_MLA_DISABLE": "1"})
    assert "PJRT_NPROC" not in env and set(serve_load.TEST_ONLY_ENV) == {"PJRT_NPROC"}
    assert env["JAXSPEC_SOMETHING_ELSE"] == "kept" and env["VLLM_MLA_DISABLE"] == "1"
    assert env["PYTHONPATH"] == str(serve_load.ROOT)
    started = {}
    monkeypatch.setattr(serve_vs_vllm.subprocess, "Popen", lambda argv, **kw: started.update(kw))
    serve_vs_vllm.start(["true"], {"X": "1"}, tmp_path / "log")
    assert "PJRT_NPROC" not in started["env"] and started["env"]["X"] == "1"


def test_in_process_benchmarks_drop_the_test_suites_simulated_mesh_setting(monkeypatch):
    # serve_long_context.py, serve_fresh.py, serve_fresh_breakdown.py (each with its children) and serve_k0_tax.py run
    # their engines in-process: they
    # drop it from their own environment before JAX starts, and their records say what they dropped
    import serve_engine

    monkeypatch.setenv("PJRT_NPROC", "32")
    monkeypatch.setenv("JAXSPEC_SOMETHING_ELSE", "kept")
    assert serve_engine.as_served() == ["PJRT_NPROC"]
    assert "PJRT_NPROC" not in serve_engine.os.environ and serve_engine.os.environ["JAXSPEC_SOMETHING_ELSE"] == "kept"
    assert serve_engine.as_served() == []
    for script in ("serve_long_context.py", "serve_fresh.py", "serve_fresh_breakdown.py", "serve_k0_tax.py"):
        text = (Path(__file__).resolve().parent.parent / "benchmarks" / script).read_text()
        assert "args = p.parse_args()\n    left_out = as_served()" in text, script  # before anything starts JAX
