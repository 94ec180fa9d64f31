"""`jaxspec serve` as one program over 2 processes x 4 CPU devices (jax.distributed over gloo, a 1x8 mesh spanning
both, as a TPU v5p-16's two hosts): process 0 serves HTTP and sends its plans to process 1 (serving/fanout.py).
The server runs `--num-steps auto`: process 0's policy picks each segment's draft shape and process 1 runs the shape
its plan names. Two completions at once come back with the text a single process with the same 1x8 mesh generates
(greedy tokens do not depend on the shapes that ran), both plain and chain programs ran with live rows on both
processes (the warm-up's calibration), and SIGTERM to process 0 drains it and ends both processes."""

import concurrent.futures
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from jaxspec import bundled, generate
from sharding.mesh import make_mesh
from tests.serving.support import NUM_STEPS, free_port, wait_healthy

# Two processes compile every program at start-up on cores other work shares (73 s in one pytest process, 72-139 s
# beside a second pytest worker): more than the default 300 s leaves room for a slower machine.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    coordinator, port = free_port(), free_port()
    logs = tmp_path_factory.mktemp("multihost_serve")
    procs = []
    for i in range(2):
        argv = [sys.executable, "-m", "jaxspec", "--cpu-devices", "4", "--coordinator", f"127.0.0.1:{coordinator}"]
        argv += ["--num-processes", "2", "--process-id", str(i), "serve", "--mesh", "1x8", "--port", str(port)]
        argv += ["--num-steps", "auto", "--max-batch", "2", "--batch-buckets", "2", "--max-context", "128"]
        argv += ["--prefill-chunk", "32", "--segment-cycles", "2"]
        with open(logs / f"process{i}.log", "w") as out:
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy()))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, procs, [logs / f"process{i}.log" for i in range(2)])
        yield procs, base, logs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _tail(logs, i: int) -> str:
    return (logs / f"process{i}.log").read_text()[-3000:]


def test_two_processes_serve_the_single_process_text_and_sigterm_ends_both(servers):
    procs, base, logs = servers
    target, drafter, tokenizer = bundled.load_pair(mesh=make_mesh("1x8"))
    prompts = [p[:60] for p in bundled.prompts()[:2]]
    out = generate(target, drafter, prompts, max_new_tokens=12, num_steps=NUM_STEPS, tokenizer=tokenizer)
    want = [tokenizer.decode([t for t in tokens if t not in tokenizer.stop_ids]) for tokens in out.tokens]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = list(
            pool.map(
                lambda p: client.completions.create(model="kimi-py-tiny", prompt=p, max_tokens=12, temperature=0),
                prompts,
            )
        )
    assert [o.choices[0].text for o in outs] == want
    ran = {
        line.split('"')[1]: float(line.split()[-1])
        for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines()
        if line.startswith("jaxspec_segments_total{")
    }
    assert sum(ran.values()) > 0, ran
    # Both shapes' programs ran on both processes with live rows before /health: the warm-up's first runs serve
    # dummy requests through each (their plans cross like any other); the policy then starts from the predicted best.
    assert "every segment program run over live rows" in (logs / "process0.log").read_text()
    procs[0].send_signal(signal.SIGTERM)
    for i, p in enumerate(procs):
        try:
            code = p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process {i} still running 120 s after SIGTERM to process 0:\n{_tail(logs, i)}")
        # uvicorn re-raises SIGTERM after its graceful shutdown (as tests/serving/test_server.py accepts).
        assert code in ((0, -signal.SIGTERM) if i == 0 else (0,)), f"process {i} exited {code}:\n{_tail(logs, i)}"
    assert "running process 0's plans" in (logs / "process1.log").read_text()
