"""The real server: `jaxspec serve` (uvicorn in a subprocess on a free port, the bundled pair), started once for the
module and driven with the official `openai` client (completions, chat, streaming) and raw HTTP for bad input,
disconnects, overload and SIGTERM."""

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.serving.conftest import NUM_STEPS

MODEL = "kimi-py-tiny"
SLOTS, QUEUE = 4, 16
CONTEXT = 1024  # room for a request that runs for seconds (the disconnect test)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "server.log"
    argv = [sys.executable, "-m", "jaxspec", "serve", "--port", str(port), "--num-steps", str(NUM_STEPS)]
    argv += ["--max-batch", str(SLOTS), "--batch-buckets", str(SLOTS), "--max-context", str(CONTEXT)]
    argv += ["--context-buckets", str(CONTEXT)]  # one context: few programs to compile (the engine tests cover more)
    argv += ["--prefill-chunk", "32", "--segment-cycles", "2", "--max-queue", str(QUEUE)]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        assert proc.poll() is None, f"server exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"server not ready:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)
    yield proc, base, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0, timeout=300)


def metric(base: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{base}/metrics").text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def text_of(pair, tokens: list[int]) -> str:
    tokenizer = pair[2]
    return tokenizer.decode([t for t in tokens if t not in tokenizer.stop_ids])


def test_completion_chat_and_stream_equal_generate(client, pair, prompts, reference):
    tokenizer = pair[2]
    assert [m.id for m in client.models.list().data] == [MODEL]
    text_prompt = tokenizer.decode(prompts[1])
    out = client.completions.create(model=MODEL, prompt=text_prompt, max_tokens=12, temperature=0)
    want = reference(tokenizer.encode(text_prompt), 12)
    assert out.choices[0].text == text_of(pair, want)
    assert out.usage.completion_tokens == len(want) and out.usage.prompt_tokens == len(tokenizer.encode(text_prompt))
    chunks = list(client.completions.create(model=MODEL, prompt=prompts[3], max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text_of(pair, reference(prompts[3], 10))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[-1].usage.completion_tokens > 0

    messages = [{"role": "user", "content": "import os"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    rendered = tokenizer.encode("user: import os\nassistant: ")  # the plain chat format (no chat tokens)
    assert chat.choices[0].message.content == text_of(pair, reference(rendered, 8))
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == chat.choices[0].message.content


def test_sixteen_concurrent_mixed_requests(client, pair, prompts, reference):
    """16 requests at once over 4 slots: mixed prompt lengths, budgets, greedy and sampled (temperature, top-k,
    top-p, seed), streamed and not. All complete; each greedy one equals its single-request output (so no output
    was lost, duplicated or mixed up with another's); each seeded sampled one equals the same request sent alone."""
    jobs = []
    for i in range(16):
        sampled = i % 3 == 1
        # top_k is an extension the openai client passes in extra_body (as for vLLM)
        params = dict(temperature=0.8, top_p=0.9, extra_body={"top_k": 30}, seed=100 + i) if sampled else {}
        params.setdefault("temperature", 0)
        jobs.append(dict(prompt=prompts[i % len(prompts)], max_tokens=4 + (i * 5) % 17, stream=i % 4 == 0, **params))

    def call(job):
        if not job["stream"]:
            out = client.completions.create(model=MODEL, **job)
            return out.choices[0].text, out.usage.completion_tokens
        text, usage = "", None
        for c in client.completions.create(model=MODEL, **job):
            text += c.choices[0].text if c.choices else ""
            usage = c.usage or usage
        return text, usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, jobs))
    for job, (text, n) in zip(jobs, results, strict=True):
        assert 1 <= n <= job["max_tokens"]
        if job["temperature"] == 0:
            assert text == text_of(pair, reference(job["prompt"], job["max_tokens"])), job
    seeded = next(j for j in jobs if j["temperature"] > 0 and not j["stream"])
    assert call(seeded) == results[jobs.index(seeded)]


def test_disconnect_mid_stream_frees_the_slot(server):
    _, base, _ = server
    count = lambda reason: metric(base, "jaxspec_requests_total", f'{{finish_reason="{reason}"}}')  # noqa: E731
    cancelled, finished = count("cancelled"), count("length") + count("stop")
    # Greedy from [5, 6, 7] runs past 1000 tokens without eos: seconds of decoding, so the slot is still held
    # when the occupancy is read after the first token (200 tokens finished first once decoding got faster).
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": CONTEXT - 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        # Keep the line iterator alive until the disconnect below: a dropped httpx line iterator is closed at once,
        # and closing it closes the connection (which made this check race the server's disconnect handling).
        lines = response.iter_lines()
        next(lines)  # the first token arrived: the request holds a slot
        held = _poll(lambda: metric(base, "jaxspec_batch_occupancy") == 1, seconds=5)
        running = (count("cancelled"), count("length") + count("stop")) == (cancelled, finished)
        assert held and running, f"slot not held mid-stream: {httpx.get(f'{base}/metrics').text[-1500:]}"
    assert _poll(lambda: metric(base, "jaxspec_batch_occupancy") == 0, seconds=30)
    assert count("cancelled") == cancelled + 1 and count("length") + count("stop") == finished


def _poll(condition, *, seconds: float) -> bool:
    """True as soon as `condition()` holds, False if it still does not after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize(
    "body, status, param",
    [
        ("{not json", 400, None),
        ({"model": MODEL, "prompt": "x", "bogus": 1}, 400, "bogus"),
        ({"model": MODEL, "prompt": "x", "temperature": 3}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
        ({"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x" * 4000}, 400, "prompt"),  # 2000 tokens
        ({"model": MODEL, "prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
        ({"model": "other", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, param):
    _, base, _ = server
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(base + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error" and error["param"] == param


def test_full_queue_answers_429_and_the_rest_complete(client, server):
    _, base, _ = server

    def call(i):
        try:
            return client.completions.create(model=MODEL, prompt=[3, 4, i], max_tokens=3, temperature=0)
        except openai.RateLimitError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        results = list(pool.map(call, range(40)))
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert limited and len(limited) <= 40 - SLOTS - QUEUE + SLOTS  # slots free up while requests arrive
    assert all(r.choices[0].finish_reason for r in results if not isinstance(r, Exception))
    out = client.completions.create(model=MODEL, prompt="def f():", max_tokens=3, temperature=0)
    assert out.choices[0].text and metric(base, "jaxspec_queue_depth") == 0
    # The draft settings the server runs (a chain of NUM_STEPS; `jaxspec serve --topk` would set a tree's).
    assert (metric(base, "jaxspec_num_steps"), metric(base, "jaxspec_topk")) == (NUM_STEPS, 1)
    assert metric(base, "jaxspec_verify_tokens") == NUM_STEPS + 1


def test_sigterm_drains_the_running_stream(server):
    """Last: SIGTERM while a stream runs; the stream still completes, then the server exits cleanly."""
    proc, base, log = server
    body = {"model": MODEL, "prompt": [9, 8, 7], "max_tokens": 40, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] in ("stop", "length") and last["usage"]["completion_tokens"] > 1
    # uvicorn re-raises the signal once it has drained and shut down: a clean exit reads -SIGTERM (or 0).
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM), log.read_text()[-2000:]
    assert "Application shutdown complete" in log.read_text()
