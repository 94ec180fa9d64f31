"""`ignore_eos` through the app (in-process, starlette's TestClient) on a real engine whose "model eos" is a token
the bundled target does generate (the real eos 0 it never makes greedily in a short answer): without the field the
choice stops there; with it, the choice runs to its budget and its tokens are plain greedy decoding's, the eos
tokens counted but not shown (as vLLM with skip_special_tokens)."""

import pytest
from fastapi.testclient import TestClient

from jaxspec.decoding import DraftShape
from jaxspec.serving.app import create_app
from jaxspec.serving.engine import Engine, EngineConfig
from tests.serving.support import NUM_STEPS

MODEL = "tiny"


@pytest.fixture(scope="module")
def eos_and_app(pair, prompts, reference):
    target, drafter, tokenizer = pair
    ref = reference(prompts[1], 24)
    eos = next(t for i, t in enumerate(ref) if i >= 3 and t not in ref[:i] and ref.count(t) >= 2)
    config = EngineConfig(max_batch=1, max_context=128, draft=DraftShape(NUM_STEPS), prefill_chunk=32, segment_cycles=2)
    engine = Engine(target, drafter, config, stop_ids=(*tokenizer.stop_ids, eos))
    engine.warmup(lambda _: None)
    with TestClient(create_app(engine, tokenizer, MODEL)) as client:
        yield eos, client


def test_ignore_eos_generates_past_the_models_eos(eos_and_app, pair, prompts, reference):
    eos, client = eos_and_app
    tokenizer = pair[2]
    ref = reference(prompts[1], 24)
    body = {"model": MODEL, "prompt": prompts[1], "max_tokens": 24, "temperature": 0}
    stopped = client.post("/v1/completions", json=body).json()
    k = ref.index(eos)
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == k + 1
    assert stopped["choices"][0]["text"] == tokenizer.decode(ref[:k])
    through = client.post("/v1/completions", json={**body, "ignore_eos": True}).json()
    assert through["choices"][0]["finish_reason"] == "length" and through["usage"]["completion_tokens"] == 24
    assert through["choices"][0]["text"] == tokenizer.decode([t for t in ref if t != eos])
    # a request stop id still stops with ignore_eos (only the model's eos is generated past)
    stop_id = next(t for t in ref[k + 1 :] if t != eos)
    body.update(ignore_eos=True, stop_token_ids=[stop_id])
    ended = client.post("/v1/completions", json=body).json()
    assert ended["usage"]["completion_tokens"] == ref.index(stop_id) + 1
    assert ended["choices"][0]["finish_reason"] == "stop"


def test_ignore_eos_on_the_per_row_program(eos_and_app, pair, prompts, reference):
    """The per-row program (logprobs ask for it) generates past the eos too; with min_tokens beyond the eos's place,
    the eos is not masked out of an ignore_eos row (it does not stop that row), so the tokens stay plain greedy's."""
    eos, client = eos_and_app
    ref = reference(prompts[1], 24)
    body = {"model": MODEL, "prompt": prompts[1], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    for extra in ({"logprobs": 1}, {"logprobs": 1, "min_tokens": ref.index(eos) + 2}):
        out = client.post("/v1/completions", json={**body, **extra}).json()
        choice = out["choices"][0]
        assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 24, extra
        assert choice["text"] == pair[2].decode([t for t in ref if t != eos]), extra
