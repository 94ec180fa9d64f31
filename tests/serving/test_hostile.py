"""Malformed and hostile requests replayed against the real server (`jaxspec serve` in a subprocess, the bundled pair)
run with API keys (from $JAXSPEC_API_KEY), the prefix cache partitioned by key, and small body limits: a table of
request -> status, error type and field, so the next field added is checked the same way; and while the table
replays, another client's stream is not disturbed.

Also: the limit /v1/models advertises is one a client can use; cache salts and keys partition the prefix cache
(`cached_tokens` 0 across them); the openai SDK works with a key and gets a 401 without; a half-sent body is dropped;
special-token text in a prompt is text.
"""

import concurrent.futures
import json
import socket
import time

import httpx
import openai
import pytest

from tests.serving.support import NUM_STEPS, running_server

MODEL = "kimi-py-tiny"
KEYS = ("key-a", "key-b")
CONTEXT, CHUNK = 256, 64  # prompts are prefilled in whole chunks plus one position: at most 192 prompt tokens
LIMIT = 193  # max_model_len: min(256 - 4 for drafting, 192 + 1)
MAX_BODY = 65536
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
LONE = '"a\\ud800b"'  # a lone surrogate, as a JSON escape: not text any encoder can take


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--num-steps", str(NUM_STEPS), "--max-batch", "2", "--batch-buckets", "2"]
    flags += ["--max-context", str(CONTEXT), "--prefill-chunk", str(CHUNK)]
    flags += ["--segment-cycles", "2", "--max-queue", "8", "--prefix-cache-salt-by-key"]
    flags += ["--max-body-bytes", str(MAX_BODY), "--body-timeout", "2"]
    with running_server(tmp_path_factory, flags, env={"JAXSPEC_API_KEY": ",".join(KEYS)}) as server:
        yield server


def body(**fields) -> dict:
    return {"model": MODEL, "prompt": "def f(x):", "max_tokens": 2, "temperature": 0} | fields


def chat(content) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


# (path, body: a dict, or raw JSON text; headers) -> (status, error type, the field named; None: 200)
CASES = [
    # bounds the device's types hold: never reach the engine
    ("/v1/completions", body(top_k=2**31), AUTH, (400, "invalid_request_error", "top_k")),
    ("/v1/completions", body(top_k=2**31 - 1, temperature=1), AUTH, None),
    ("/v1/completions", body(top_p=1e-39, temperature=1), AUTH, (400, "invalid_request_error", "top_p")),
    ("/v1/completions", body(top_p=1e-30, temperature=1), AUTH, None),
    ("/v1/completions", json.dumps(body(temperature="X")).replace('"X"', "NaN"), AUTH, (400, None, "temperature")),
    ("/v1/completions", body(seed=2**32), AUTH, (400, "invalid_request_error", "seed")),
    ("/v1/completions", body(seed=2**32 - 1, temperature=1), AUTH, None),
    # undecodable text, empty prompt lists
    ("/v1/completions", json.dumps(body(prompt="X")).replace('"X"', LONE), AUTH, (400, None, "prompt")),
    ("/v1/completions", json.dumps(body(stop="X")).replace('"X"', LONE), AUTH, (400, None, "stop")),
    ("/v1/chat/completions", json.dumps(chat("X")).replace('"X"', LONE), AUTH, (400, None, "messages.0.content")),
    (
        "/v1/chat/completions",
        json.dumps(chat([{"type": "text", "text": "X"}])).replace('"X"', LONE),
        AUTH,
        (400, None, "messages.0.content.0.text"),
    ),
    ("/tokenize", json.dumps({"prompt": "X"}).replace('"X"', LONE), AUTH, (400, None, "prompt")),
    ("/v1/completions", body(prompt=[]), AUTH, (400, None, "prompt")),
    ("/v1/completions", body(prompt=[], stream=True), AUTH, (400, None, "prompt")),
    (
        "/v1/completions",
        body(prompt=[], stream=True, stream_options={"include_usage": True}),
        AUTH,
        (400, None, "prompt"),
    ),
    # lengths
    ("/v1/completions", body(stop="x" * 257), AUTH, (400, None, "stop")),
    ("/v1/completions", body(user="u" * 257), AUTH, (400, None, "user")),
    ("/v1/completions", body(cache_salt=""), AUTH, (400, None, "cache_salt")),
    ("/v1/completions", body(prompt="x" * (MAX_BODY + 1)), AUTH, (413, None, None)),
    # the context: the rule stated, and the limit advertised holds
    ("/v1/completions", body(prompt=[5] * 193, max_tokens=1), AUTH, (400, None, "prompt")),
    ("/v1/completions", body(prompt=[5] * 150, max_tokens=LIMIT - 150), AUTH, None),
    # keys and models
    ("/v1/completions", body(), {}, (401, None, None)),
    ("/v1/completions", body(), {"Authorization": "Bearer key-c"}, (401, None, None)),
    ("/tokenize", {"prompt": "x"}, {}, (401, None, None)),
    ("/v1/models", None, {}, (401, None, None)),
    ("/v1/completions", body(model="other", prompt="x" * 60_000), AUTH, (404, None, "model")),
]


def send(base: str, path: str, payload, headers: dict) -> httpx.Response:
    if payload is None:
        return httpx.get(base + path, headers=headers, timeout=120)
    content = payload if isinstance(payload, str) else json.dumps(payload)
    headers = {"content-type": "application/json", **headers}
    return httpx.post(base + path, content=content, headers=headers, timeout=120)


def check(case, r: httpx.Response) -> None:
    path, payload, _, expected = case
    if expected is None:
        assert r.status_code == 200, r.text
        return
    status, kind, param = expected
    assert r.status_code == status, (path, str(payload)[:200], r.text)
    error = r.json()["error"]
    assert error["type"] == (kind or "invalid_request_error") and error["param"] == param, error
    assert param is None or param.split(".")[0] in error["message"], error


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_each_hostile_request_gets_its_status(server, case):
    check(case, send(server[1], case[0], case[1], case[2]))


def stream_text(base: str) -> tuple[str, str]:
    """A long greedy stream: its text and its last event."""
    payload = body(prompt="import os\n", max_tokens=48, stream=True)
    with httpx.stream("POST", f"{base}/v1/completions", json=payload, headers=AUTH, timeout=300) as response:
        events = [line for line in response.iter_lines() if line]
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks), events[-1]


def test_the_table_replayed_during_a_stream_leaves_that_stream_intact(server):
    base = server[1]
    alone, _ = stream_text(base)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        stream = pool.submit(stream_text, base)
        for case, r in zip(CASES, pool.map(lambda c: send(base, c[0], c[1], c[2]), CASES), strict=True):
            check(case, r)
        text, last = stream.result()
    assert last == "data: [DONE]" and text == alone


def test_refusals_state_the_rule_and_the_advertised_limit_holds(server):
    base = server[1]
    card = httpx.get(f"{base}/v1/models", headers=AUTH).json()["data"][0]
    assert card["max_model_len"] == LIMIT
    # 193 + 1 + 4 for drafting fits 256: the prefill's whole chunks refuse it, and the message says so
    message = send(base, "/v1/completions", body(prompt=[5] * 193, max_tokens=1), AUTH).json()["error"]["message"]
    assert "prompt of 193 tokens exceeds the context of 256 positions" in message
    assert "chunks of 64 positions plus one (193 tokens take 257)" in message and f"up to {LIMIT} always" in message
    fits = send(base, "/v1/completions", body(prompt=[5] * 192, max_tokens=1), AUTH)
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 1
    # a NaN temperature is refused as what it is (not as "should be <= 2"); a seed past 32 bits is not wrapped
    nan = json.dumps(body(temperature="X")).replace('"X"', "NaN")
    assert "finite number" in send(base, "/v1/completions", nan, AUTH).json()["error"]["message"]
    assert "4294967295" in send(base, "/v1/completions", body(seed=2**32 + 7), AUTH).json()["error"]["message"]


def test_cache_salts_and_keys_partition_the_prefix_cache(server):
    base = server[1]
    prompt = [(7 * i) % 200 + 3 for i in range(150)]

    def cached(key: str, **salt) -> int:
        headers = {"Authorization": f"Bearer {key}"}
        r = send(base, "/v1/completions", body(prompt=prompt, max_tokens=1, **salt), headers)
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(KEYS[0], cache_salt="s1") == 0
    assert cached(KEYS[0], cache_salt="s1") == 128  # the same key and salt: two whole chunks reused
    assert cached(KEYS[0], cache_salt="s2") == 0 and cached(KEYS[0]) == 0  # another salt, or none
    assert cached(KEYS[1], cache_salt="s1") == 0  # another key, the same salt


def test_the_openai_sdk_works_with_a_key_and_gets_401_without(server):
    base = server[1]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEYS[1], max_retries=0, timeout=120)
    out = client.completions.create(model=MODEL, prompt="def f():", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    assert [m.id for m in client.models.list()] == [MODEL]
    wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert httpx.get(f"{base}/health").status_code == 200  # open


def test_a_half_sent_body_is_answered_408_and_closed(server):
    host, port = server[1].removeprefix("http://").split(":")
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH['Authorization']}\r\n"
    head += "Content-Type: application/json\r\nContent-Length: 60000\r\n\r\n{"
    with socket.create_connection((host, int(port)), timeout=20) as conn:
        conn.sendall(head.encode())
        start = time.monotonic()
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
        took = time.monotonic() - start
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply, reply[:300]
    assert 1.5 < took < 15  # the body timeout (2 s), then the connection closed (recv returned b"")


def test_special_token_text_in_a_prompt_is_text(server):
    base = server[1]
    eos = httpx.post(f"{base}/detokenize", json={"tokens": [0]}, headers=AUTH).json()["prompt"]
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": f"a{eos}b"}, headers=AUTH).json()["tokens"]
    assert 0 not in tokens and len(tokens) > 3
