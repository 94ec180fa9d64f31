"""The real server: `jaxspec serve` (uvicorn in a subprocess on a free port, the bundled pair), started once for the
module and driven with the official `openai` client (completions, chat, streaming) and raw HTTP for bad input,
disconnects, overload and SIGTERM."""

import concurrent.futures
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from jaxspec import generate
from tests.serving.conftest import REF_TOKENS
from tests.serving.support import NUM_STEPS, expected_text, running_server

MODEL = "kimi-py-tiny"
SLOTS, QUEUE = 4, 16
CONTEXT = 1024  # room for a request that runs for seconds (the disconnect test)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--num-steps", str(NUM_STEPS), "--max-batch", str(SLOTS), "--batch-buckets", str(SLOTS)]
    flags += ["--max-context", str(CONTEXT)]
    flags += ["--prefill-chunk", "32", "--segment-cycles", "2", "--max-queue", str(QUEUE)]
    with running_server(tmp_path_factory, flags) as server:
        yield server


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
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)

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
        for c in client.completions.create(model=MODEL, stream_options={"include_usage": True}, **job):
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
    count = lambda reason: metric(base, "jaxspec_requests_total", f'{{finish_reason="{reason}"}}')
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


CHAT = [{"role": "user", "content": "x"}]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.mark.parametrize(
    "body, status, param",
    [
        ("{not json", 400, None),
        ({"model": MODEL, "prompt": "x", "bogus": 1}, 400, "bogus"),
        ({"model": MODEL, "prompt": "x", "temperature": 3}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "n": SLOTS + 1}, 400, "n"),
        ({"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [[1, 2], [3, 99999]]}, 400, "prompt.1"),
        ({"model": MODEL, "prompt": [[1, 2], []]}, 400, "prompt.1"),
        ({"model": MODEL, "prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
        ({"model": MODEL, "prompt": "x" * 4000}, 400, "prompt"),  # 2000 tokens
        ({"model": MODEL, "prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
        ({"model": "other", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
        # fields this server does not implement: a 400 that names them (a neutral value passes, see below)
        ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"model": MODEL, "prompt": "x", "top_logprobs": 2}, 400, "top_logprobs"),  # a chat field
        ({"model": MODEL, "messages": CHAT, "echo": True}, 400, "echo"),
        ({"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"model": MODEL, "messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
        ({"model": MODEL, "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"model": MODEL, "messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ({"model": MODEL, "messages": CHAT, "response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"model": MODEL, "messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        ({"model": MODEL, "messages": CHAT, "max_completion_tokens": 10_000}, 400, "max_completion_tokens"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, IMAGE]}]},
            400,
            "messages.0.content.1",
        ),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, param):
    _, base, _ = server
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(base + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param is None or param.split(".")[0] in error["message"], error  # the message names the field too


def test_neutral_values_of_unimplemented_fields_pass(client):
    """What SDKs send by default (logprobs false, penalties 0, tool_choice none, n 1) is accepted."""
    neutral = dict(logprobs=False, presence_penalty=0, frequency_penalty=0.0, n=1, tool_choice="none")
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0, **neutral)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 2


def test_full_queue_answers_429_and_the_rest_complete(client, server, pair, reference):
    _, base, _ = server

    def call(i):
        try:
            return client.completions.create(model=MODEL, prompt=[3, 4, i], max_tokens=3, temperature=0)
        except openai.RateLimitError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        results = list(pool.map(call, range(40)))
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    # At least a full queue gets in (more when slots free up while requests arrive); the rest get 429 queue_full.
    assert limited and len(limited) <= 40 - QUEUE
    assert all(e.status_code == 429 and e.body["code"] == "queue_full" for e in limited)
    done = [(i, r) for i, r in enumerate(results) if not isinstance(r, Exception)]
    # Greedy from [3, 4, i] makes no eos in 3 tokens: each admitted request ran to its budget.
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3 for _, r in done)
    for i, r in done[:3]:
        assert r.choices[0].text == text_of(pair, reference([3, 4, i], 3))
    out = client.completions.create(model=MODEL, prompt="def f():", max_tokens=3, temperature=0)
    assert out.choices[0].text and metric(base, "jaxspec_queue_depth") == 0
    # The draft settings the server runs (a chain of NUM_STEPS; `jaxspec serve --topk` would set a tree's).
    assert (metric(base, "jaxspec_num_steps"), metric(base, "jaxspec_topk")) == (NUM_STEPS, 1)
    assert metric(base, "jaxspec_verify_tokens") == NUM_STEPS + 1
    # Segments by draft shape (a fixed chain: all of them), and the last one's predicted and measured tokens/s.
    assert metric(base, "jaxspec_segments_total", f'{{draft="k={NUM_STEPS}"}}') > 0
    assert metric(base, "jaxspec_segment_predicted_tokens_per_second") > 0
    assert metric(base, "jaxspec_segment_measured_tokens_per_second") > 0
    # A fixed chain feeds the drafter every prompt chunk.
    assert metric(base, "jaxspec_prefill_chunks_total", '{drafter="fed"}') > 0


def _both_modes(client, chat: bool, **kw) -> tuple[tuple[str, int, str], tuple[str, int, str]]:
    """(text, completion_tokens, finish_reason) of the same request non-streamed and streamed (with usage)."""
    create = client.chat.completions.create if chat else client.completions.create
    out = create(model=MODEL, **kw)
    answer = (out.choices[0].message.content if chat else out.choices[0].text, out.usage.completion_tokens)
    chunks = list(create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw))
    # usage only on the extra last chunk, which has no choices (as OpenAI)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason
    parts = [(c.choices[0].delta.content if chat else c.choices[0].text) or "" for c in chunks[:-1]]
    streamed = ("".join(parts), chunks[-1].usage.completion_tokens, chunks[-2].choices[0].finish_reason)
    return (*answer, out.choices[0].finish_reason), streamed


def test_stream_equals_answer_for_every_stop_string(client, pair, prompts, reference):
    """Stop strings at the first token, inside a token, across token (and engine update) boundaries and competing:
    the stream's text, usage and finish reason equal the non-streamed answer's, and both equal the brute-force
    expectation over the greedy tokens (multi-byte characters: tests/serving/test_text.py)."""
    tokenizer = pair[2]
    ref = reference(prompts[1], 24)
    text = text_of(pair, ref)
    at = [len(tokenizer.decode(ref[:k])) for k in range(len(ref) + 1)]  # text offset after k tokens
    wide = next(k for k in range(8, 24) if at[k + 1] - at[k] >= 3)  # a token with >= 3 characters
    stops = [
        [text[0]],  # completes at the first token
        [text[at[wide] + 1 : at[wide + 1]]],  # inside one token
        *([text[at[k] - 1 : at[k] + 1]] for k in (3, 7, 12, 18)),  # across two tokens
        [text[at[5] - 1 : at[9] + 1]],  # across several tokens
        [text[at[16] : at[17] + 1], text[at[10] : at[10] + 1], "never-generated"],  # the earliest wins
    ]
    for stop in stops:
        want_text, want_count = expected_text(tokenizer, ref, stop)
        answer, streamed = _both_modes(client, False, prompt=prompts[1], max_tokens=24, temperature=0, stop=stop)
        assert answer == streamed == (want_text, want_count, "stop"), stop
    messages = [{"role": "user", "content": "import os"}]
    chat_ref = reference(tokenizer.encode("user: import os\nassistant: "), 16)
    stop = [text_of(pair, chat_ref)[3:5]]
    answer, streamed = _both_modes(client, True, messages=messages, max_tokens=16, temperature=0, stop=stop)
    assert answer == streamed == (*expected_text(tokenizer, chat_ref, stop), "stop")


def test_prompt_lists_give_one_choice_per_prompt_in_order(client, pair, prompts, reference):
    tokenizer = pair[2]
    text_prompt = tokenizer.decode(prompts[1])
    texts = [text_prompt, text_prompt[:40]]
    out = client.completions.create(model=MODEL, prompt=texts, max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [text_of(pair, reference(tokenizer.encode(t), 6)) for t in texts]
    ids = [prompts[2], prompts[4], prompts[3]]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [text_of(pair, reference(p, 5)) for p in ids]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (sum(map(len, ids)), 15)
    one = client.completions.create(model=MODEL, prompt=[prompts[2]], max_tokens=5, temperature=0)
    assert [c.text for c in one.choices] == [out.choices[0].text]
    # streamed, the choices' chunks interleave; each choice's deltas join to its answer
    joined = ["", "", ""]
    for c in client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, stream=True):
        joined[c.choices[0].index] += c.choices[0].text
    assert joined == [c.text for c in out.choices]


def test_n_samples_reproducible_per_seed_and_independent(client, pair, prompts, reference):
    kw = dict(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=1.0, seed=7)
    first, again = (client.completions.create(n=2, **kw) for _ in range(2))
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1] and texts == [c.text for c in again.choices]
    assert texts[0] != texts[1]  # each choice has its own seed
    assert client.completions.create(n=1, **kw).choices[0].text == texts[0]  # choice 0 keeps the request's seed
    assert first.usage.completion_tokens == 24 and first.usage.prompt_tokens == len(prompts[0])
    greedy = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=6, temperature=0, n=3)
    assert [c.text for c in greedy.choices] == [text_of(pair, reference(prompts[0], 6))] * 3


def speculation(obj: dict) -> dict:
    """The `metrics.speculative_decoding` object of a response body, chunk or choice."""
    return obj["metrics"]["speculative_decoding"]


def check_speculation(spec: dict, completion_tokens: int, choices: int = 1) -> None:
    """The object as vLLM documents it (its names; the histogram dense over 0..num_spec_tokens; the mean and the rate
    from the counts), the identities aiperf checks, and the tokens the counts account for: the prefill's first token,
    then per cycle its accepted drafts and one more, of which the last cycle may have accepted past the budget or a
    stop id (at most num_spec_tokens)."""
    hist, steps, accepted = spec["acceptance_histogram"], spec["num_spec_steps"], spec["num_accepted_draft_tokens"]
    assert spec["num_spec_tokens"] == NUM_STEPS and len(hist) == NUM_STEPS + 1 and sum(hist) == steps
    assert sum(j * c for j, c in enumerate(hist)) == accepted == sum(spec["num_accepted_tokens_per_pos"])
    assert spec["num_draft_tokens"] == NUM_STEPS * steps and accepted <= spec["num_draft_tokens"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
    assert spec["draft_acceptance_rate"] == pytest.approx(accepted / spec["num_draft_tokens"])
    assert spec["draft_shapes"] == {f"chain k={NUM_STEPS}": steps}  # a fixed chain: every cycle drafts
    over = choices + steps + accepted - completion_tokens
    assert 0 <= over <= NUM_STEPS * choices, (spec, completion_tokens)


def stream_bodies(base: str, path: str, body: dict) -> list[dict]:
    """A stream's chunks, as JSON."""
    with httpx.stream("POST", f"{base}{path}", json=body | {"stream": True}, timeout=300) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def aiperf_record(bodies: list[dict]) -> dict | None:
    """aiperf's per-request acceptance record of these response bodies: aiperf's own parser
    (tests/serving/aiperf_record.py) in this interpreter when aiperf is installed here, or in $AIPERF_PYTHON's
    (aiperf's own venv); else the rules that parser applies, as aiperf 0.13's source has them (`documented_record`)."""
    script = Path(__file__).with_name("aiperf_record.py")
    python = sys.executable
    try:
        import aiperf  # noqa: F401
    except ImportError:
        python = os.environ.get("AIPERF_PYTHON")
        if python is None:
            return documented_record(bodies)
    done = subprocess.run([python, str(script)], input=json.dumps(bodies), capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def documented_record(bodies: list[dict]) -> dict:
    """What aiperf 0.13 reads (endpoints/base_endpoint.py, spec_decode/vllm_adapter.py, inference_result_parser.py):
    the root `metrics.speculative_decoding` of exactly one body of the response (a stream carrying it twice is
    dropped), its histogram num_spec_tokens + 1 long, summing to the steps, its j-weighted sum the accepted drafts."""
    roots = [b["metrics"]["speculative_decoding"] for b in bodies if "metrics" in b]
    assert len(roots) == 1, roots
    spec = roots[0]
    hist = spec["acceptance_histogram"]
    assert len(hist) == spec["num_spec_tokens"] + 1 and sum(hist) == spec["num_spec_steps"], spec
    assert sum(j * n for j, n in enumerate(hist)) == spec["num_accepted_draft_tokens"], spec
    names = ("num_spec_steps", "num_spec_tokens", "num_accepted_draft_tokens", "num_draft_tokens")
    return {k: spec[k] for k in names} | {"acceptance_histogram": hist}


@pytest.fixture(scope="module")
def acceptance(pair, prompts):
    """(prompt, the chat messages, and per one of them its single-request `generate` stats), greedy, REF_TOKENS."""
    target, drafter, tokenizer = pair
    messages = [{"role": "user", "content": "def fib(n):"}]
    rendered = tokenizer.encode("user: def fib(n):\nassistant: ")  # the plain chat format
    run = lambda ids: (
        generate(  # noqa: E731
            target, drafter, [ids], max_new_tokens=REF_TOKENS, num_steps=NUM_STEPS, tokenizer=tokenizer
        ).stats
    )
    return prompts[1], messages, run(prompts[1]), run(rendered)


def test_every_choice_carries_its_speculation_exactly(server, acceptance):
    """Greedy requests on both endpoints, n = 3, streamed and not: each choice's counts are those of the same prompt
    alone through `jaxspec.generate` (cycles, accepted per position, histogram: exact); the root's are the sum; a
    stream carries each choice's on its final chunk and the root's once, on its last chunk; aiperf reads the same."""
    prompt, messages, *stats = acceptance
    base = server[1]
    requests = [("/v1/completions", dict(prompt=prompt)), ("/v1/chat/completions", dict(messages=messages))]
    for (path, body), ref in zip(requests, stats, strict=True):
        body = body | dict(model=MODEL, max_tokens=REF_TOKENS, temperature=0, n=3)
        want = {
            "num_spec_steps": ref["cycles"],
            "num_accepted_tokens_per_pos": ref["accepted"],
            "acceptance_histogram": ref["accepted_length_histogram"],
        }
        out = httpx.post(f"{base}{path}", json=body, timeout=300).json()
        assert len(out["choices"]) == 3
        for c in out["choices"]:
            spec = speculation(c)
            assert {k: spec[k] for k in want} == want, (path, spec, ref)
            check_speculation(spec, out["usage"]["completion_tokens"] // 3)
        root = speculation(out)
        assert root["num_spec_steps"] == 3 * ref["cycles"]
        check_speculation(root, out["usage"]["completion_tokens"], choices=3)

        for usage in (False, True):
            chunks = stream_bodies(base, path, body | {"stream_options": {"include_usage": usage}})
            finals = {c["index"]: c for chunk in chunks for c in chunk["choices"] if c["finish_reason"]}
            assert sorted(finals) == [0, 1, 2]
            assert all(speculation(finals[i]) == speculation(c) for i, c in enumerate(out["choices"]))
            roots = [chunk for chunk in chunks if "metrics" in chunk]
            assert len(roots) == 1 and roots[0] is chunks[-1] and speculation(roots[0]) == root, roots
        one = httpx.post(f"{base}{path}", json=body | {"n": 1}, timeout=300).json()
        assert speculation(one) == speculation(one["choices"][0]) == speculation(out["choices"][0])
        record = aiperf_record([one])
        assert record["num_spec_steps"] == ref["cycles"] and record["num_spec_tokens"] == NUM_STEPS
        assert record["num_accepted_draft_tokens"] == sum(ref["accepted"]), record
        chunks = stream_bodies(base, path, body | {"n": 1, "stream_options": {"include_usage": True}})
        assert aiperf_record(chunks) == record


def test_chat_content_parts_and_max_completion_tokens(client, pair, reference):
    rendered = pair[2].encode("user: import os\nassistant: ")
    parts = [{"type": "text", "text": "import"}, {"type": "text", "text": " os"}]
    messages = [{"role": "user", "content": parts}]
    # max_completion_tokens (OpenAI's current name) wins over max_tokens
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, max_completion_tokens=5, temperature=0
    )
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (5, "length")
    assert out.choices[0].message.content == text_of(pair, reference(rendered, 5))


def test_stop_token_ids_end_the_choice_at_that_token(client, pair, prompts, reference):
    ref = reference(prompts[5], 24)
    k = next(i for i in range(3, 24) if ref[i] not in ref[:i])  # a token's first occurrence, past the start
    out = client.completions.create(
        model=MODEL, prompt=prompts[5], max_tokens=24, temperature=0, extra_body={"stop_token_ids": [ref[k]]}
    )
    assert (out.choices[0].text, out.usage.completion_tokens) == (text_of(pair, ref[:k]), k + 1)
    assert out.choices[0].finish_reason == "stop"
    # min_tokens masks it on the device until k + 3 tokens exist (the same tokens before it; another one at k)
    extra = {"stop_token_ids": [ref[k]], "min_tokens": k + 3}
    out = client.completions.create(model=MODEL, prompt=prompts[5], max_tokens=24, temperature=0, extra_body=extra)
    assert out.usage.completion_tokens >= k + 3 and out.choices[0].text.startswith(text_of(pair, ref[:k]))
    assert out.choices[0].text != text_of(pair, ref)[: len(out.choices[0].text)]


def test_endpoints_models_tokenize_version_and_head(client, server, pair):
    _, base, _ = server
    tokenizer = pair[2]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    for path in ("/health", "/metrics", "/v1/models", f"/v1/models/{MODEL}", "/version"):
        got, head = httpx.get(base + path), httpx.head(base + path)
        assert (got.status_code, head.status_code) == (200, 200) and got.content and head.content == b"", path
    assert httpx.get(base + "/version").json() == {"version": importlib.metadata.version("jaxspec")}
    text = "def parse(path):"
    body = {"model": MODEL, "prompt": text, "return_token_strs": True}
    r = httpx.post(base + "/tokenize", json=body).json()
    assert r["tokens"] == tokenizer.encode(text) and r["count"] == len(r["tokens"])
    # what always fits: prompts are prefilled in whole chunks of 32 and one position more (992 + 1 < 1024 - 4)
    assert (
        r["max_model_len"] == (CONTEXT - 1) // 32 * 32 + 1 == client.models.retrieve(MODEL).model_extra["max_model_len"]
    )
    assert "".join(r["token_strs"]) == text
    chat = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "import os"}]}).json()
    assert chat["tokens"] == tokenizer.encode("user: import os\nassistant: ") and chat["token_strs"] is None
    assert httpx.post(base + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json() == {"prompt": text}
    bad = [("/detokenize", {"tokens": [99999]}, 400), ("/tokenize", {"model": "other", "prompt": "x"}, 404)]
    bad.append(("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400))
    for path, body, status in bad:
        assert httpx.post(base + path, json=body).status_code == status, (path, body)


def test_logprobs_and_echo_in_openai_shapes(client, pair, prompts, reference):
    """Completions `logprobs: N` with `echo` (the prompt first, its first token unscored), `max_tokens: 0` scoring a
    prompt, chat `logprobs` + `top_logprobs`, and streams whose chunks' logprobs join to the answer's. The values
    themselves are checked against a full forward in tests/serving/test_logprobs.py."""
    tokenizer = pair[2]
    prompt, ref = prompts[4], reference(prompts[4], 6)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, echo=True)
    out = client.completions.create(**kw)
    choice, n = out.choices[0], len(prompt)
    lp = choice.logprobs
    assert choice.text == tokenizer.decode(prompt) + text_of(pair, ref) and out.usage.completion_tokens == len(ref)
    assert lp.tokens == [tokenizer.decode([t]) for t in prompt + ref]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert len(top) in (3, 4) and token in top and logprob <= 0  # the chosen token is always listed
    assert all(lp.token_logprobs[n + i] == max(lp.top_logprobs[n + i].values()) for i in range(len(ref)))  # greedy

    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert scored.choices[0].text == tokenizer.decode(prompt) and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n], abs=1e-5)

    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    joined = [x for c in chunks if c.logprobs for x in zip(c.logprobs.tokens, c.logprobs.text_offset, strict=True)]
    assert "".join(c.text for c in chunks) == choice.text and joined == list(
        zip(lp.tokens, lp.text_offset, strict=True)
    )

    chat_kw = dict(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    chat = client.chat.completions.create(**chat_kw)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(c.token for c in content).startswith(chat.choices[0].message.content)
    for c in content:
        assert bytes(c.bytes) == c.token.encode() and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob  # greedy
    streamed = [
        x
        for c in client.chat.completions.create(**chat_kw, stream=True)
        if c.choices
        for x in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])
    ]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_chat_requests_sharing_a_system_prompt_reuse_its_cache(client, server):
    """The second chat with the same long system prompt reuses its cached blocks (usage's cached_tokens, the
    prefix-cache metrics) and answers as the first did; a different user turn reuses them too."""
    base = server[1]
    system = {"role": "system", "content": "You review Python code for a small team. " * 12}
    chat = lambda user: client.chat.completions.create(
        model=MODEL, messages=[system, {"role": "user", "content": user}], max_tokens=6, temperature=0
    )
    hits = metric(base, "jaxspec_prefix_cache_hits_total")
    first, again, other = chat("import os"), chat("import os"), chat("def f(x):")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64 and cached % 32 == 0 and cached < again.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content
    assert other.usage.prompt_tokens_details.cached_tokens >= 64
    assert metric(base, "jaxspec_prefix_cache_hits_total") >= hits + 128
    assert metric(base, "jaxspec_prefix_cache_queries_total") >= 3 * first.usage.prompt_tokens
    assert metric(base, "jaxspec_kv_cache_blocks") == SLOTS * CONTEXT // 32
    assert "jaxspec_kv_cache_usage_perc" in httpx.get(f"{base}/metrics").text


def test_sigterm_drains_the_running_stream(server, pair, reference):
    """Last: SIGTERM while a stream runs; the stream still completes (every token of the greedy answer), then the
    server exits cleanly and stops taking connections."""
    proc, base, log = server
    body = {"model": MODEL, "prompt": [9, 8, 7], "max_tokens": 24, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        first = next(lines)
        proc.send_signal(signal.SIGTERM)
        events = [first] + [line for line in lines if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text_of(pair, reference([9, 8, 7], 24))
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 24
    # uvicorn re-raises the signal once it has drained and shut down: a clean exit reads -SIGTERM (or 0).
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM), log.read_text()[-2000:]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{base}/health", timeout=2)
