"""The serving engine with the fp8 latent cache (`jaxspec serve --kv-cache-dtype fp8`): its greedy output equals
plain decoding of the same fp8-cache target, request by request."""

from jaxspec import generate
from jaxspec.decoding import DraftShape
from jaxspec.serving.engine import Engine, EngineConfig, Request

CONFIG = EngineConfig(
    max_batch=2,
    max_context=64,
    draft=DraftShape(3),
    prefill_chunk=16,
    segment_cycles=2,
    max_queue=4,
    batch_buckets=(2,),
    greedy_program=True,
)


def test_fp8_engine_greedy_equals_plain_with_the_same_cache(pair, prompts):
    target, drafter, tokenizer = pair
    fp8 = target.with_kv_cache_dtype("fp8")
    engine = Engine(fp8, drafter, CONFIG, stop_ids=tokenizer.stop_ids)
    assert engine.executor.pool.target.dtype.name == "uint8"
    requests = [Request(prompts[i], 10) for i in (0, 2, 4)]
    for r in requests:
        engine.submit(r)
    engine.run_until_idle()
    plain = generate(fp8, None, [r.prompt for r in requests], max_new_tokens=10, num_steps=0, tokenizer=tokenizer)
    for r, ref in zip(requests, plain.tokens, strict=True):
        assert r.finished and r.tokens == ref, r.prompt
