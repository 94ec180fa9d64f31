"""Shared by the serving tests: the bundled pair (loaded once) and single-request `jaxspec.generate` references."""

import contextlib
import functools
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from jaxspec import bundled, generate

NUM_STEPS = 3  # the depth both the engine tests and the test server run
REF_TOKENS = 24  # references are generated once per prompt with this budget (greedy output for a smaller budget is
# its prefix), so few programs compile; tests ask for at most this many tokens


@pytest.fixture(scope="session")
def pair():
    return bundled.load_pair()


@pytest.fixture(scope="session")
def prompts(pair):
    """Held-out prompts as token ids, cut to mixed lengths (some span several prefill chunks)."""
    tokenizer = pair[2]
    ids = [tokenizer.encode(p) for p in bundled.prompts()]
    lengths = [5, 43, 17, 30, 9, 60, 24, 12]
    return [ids[i % len(ids)][: lengths[i % len(lengths)]] for i in range(8)]


@pytest.fixture(scope="session")
def reference(pair):
    """reference(prompt_ids, max_tokens) -> greedy tokens of a single-request `jaxspec.generate` call."""
    target, drafter, tokenizer = pair

    @functools.cache
    def run(prompt: tuple[int, ...]) -> list[int]:
        out = generate(
            target, drafter, [list(prompt)], max_new_tokens=REF_TOKENS, num_steps=NUM_STEPS, tokenizer=tokenizer
        )
        return out.tokens[0]

    def reference(prompt, max_tokens: int) -> list[int]:
        assert max_tokens <= REF_TOKENS, f"reference: raise REF_TOKENS to {max_tokens}"
        return run(tuple(prompt))[:max_tokens]

    return reference


def warm_engine(pair, config):
    """An `Engine` on the bundled pair with `config`, every program compiled (warm-up)."""
    from jaxspec.serving.engine import Engine

    target, drafter, tokenizer = pair
    engine = Engine(target, drafter, config, stop_ids=tokenizer.stop_ids)
    engine.warmup(lambda _: None)
    return engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, procs: list, logs: list, timeout: float = 600) -> None:
    """Until `base`/health answers 200; fails (with the log's tail) when a process exits or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
            assert p.poll() is None, f"process {i} exited ({p.returncode}):\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "not ready:\n" + "\n".join(log.read_text()[-3000:] for log in logs)
        time.sleep(0.5)


@contextlib.contextmanager
def running_server(tmp_path_factory, flags: list[str], env: dict[str, str] | None = None):
    """`jaxspec serve FLAGS` (uvicorn in a subprocess on a free port) until it answers /health; yields (process,
    base url, log path) and kills it afterwards if it is still running."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    argv = [sys.executable, "-m", "jaxspec", "serve", "--port", str(port), *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, [proc], [log])
        yield proc, base, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
