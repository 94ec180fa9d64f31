"""`jaxspec serve` with its default policy (`--num-steps auto`, `--sampling auto`; small buckets so it starts quickly):
a seeded request at temperature 1 gives the same text alone, beside seven others, as choice 0 of n = 3 and streamed,
and that text is plain decoding's with the same seed (`jaxspec.generate(..., num_steps=0, sampling="coupled")`):
coupled sampling makes it independent of the draft shapes the policy picks under each load."""

import concurrent.futures

import httpx
import openai
import pytest

from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.sampling_params import RowSpec
from tests.serving.support import running_server

MODEL = "kimi-py-tiny"
TOKENS = 20
# -m slow (a server of its own: ~65 s; test budget). The default suite checks the same property on the engine under
# scripted draft shapes (test_adaptive, test_engine_tree, test_engine_pool).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--max-batch", "8", "--batch-buckets", "8", "--max-context", "128"]
    with running_server(tmp_path_factory, flags) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0, timeout=300)


def text_of(pair, tokens: list[int]) -> str:
    tokenizer = pair[2]
    return tokenizer.decode([t for t in tokens if t not in tokenizer.stop_ids])


def test_a_seed_gives_one_text_whatever_the_load(client, pair, prompts, coupled_reference):
    prompt, seed = prompts[2], 1234
    kw = dict(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=1.0, seed=seed)
    want = text_of(pair, coupled_reference(prompt, TOKENS, RowSpec(Sampling(1.0), seed=seed, coupled=True)))
    assert client.completions.create(**kw).choices[0].text == want  # alone
    others = [dict(kw, prompt=p, seed=None) for p in prompts[3:7]] + [dict(kw, temperature=0)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # 8 at once: the policy sees another load
        busy = list(pool.map(lambda k: client.completions.create(**k), [kw, kw, *others]))
    assert [r.choices[0].text for r in busy[:2]] == [want, want]
    three = client.completions.create(n=3, **kw)
    assert three.choices[0].text == want and len({c.text for c in three.choices}) > 1
    stream = client.completions.create(stream=True, **kw)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want


def test_a_request_may_choose_rejection_sampling(server, client, prompts):
    """`"sampling": "rejection"` (the extra field) on a seeded request draws otherwise than coupled sampling (its
    text may then depend on the draft shapes the policy picks); an unknown mode is refused by name."""
    kw = dict(model=MODEL, prompt=prompts[2], max_tokens=TOKENS, temperature=1.0, seed=1234)
    rejection = client.completions.create(extra_body={"sampling": "rejection"}, **kw)
    assert rejection.choices[0].text != client.completions.create(**kw).choices[0].text
    bad = httpx.post(f"{server[1]}/v1/completions", json=dict(kw, sampling="gumbel"), timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling", bad.text
