"""The serving engine's output on a fixed workload, as a digest to compare across commits (a refactor of the engine
must not change a token).

The workload: the bundled pair, 4 slots, 12 requests over the held-out prompts (greedy, and seeded sampled at two
settings), submitted at once, driven by `Engine.step`, for a chain (k = 3), plain decoding (k = 0) and a tree
(3:2:6). It prints one JSON line per draft with the SHA-256 of every request's tokens in submission order. Run it on
two checkouts and compare the lines (it speaks the EngineConfig of before and after the draft-shape change):

    python benchmarks/engine_outputs.py > after.jsonl
    git worktree add ../before <commit> && cp benchmarks/engine_outputs.py ../before/benchmarks/
    (cd ../before && PYTHONPATH=$PWD python benchmarks/engine_outputs.py) > before.jsonl
    diff before.jsonl after.jsonl
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

DRAFTS = ((3, 1, None), (0, 1, None), (3, 2, 6))  # (num_steps, topk, num_draft_tokens)


def engine_config(num_steps: int, topk: int, num_draft_tokens: int | None):
    from jaxspec.serving.engine import EngineConfig

    shape = dict(max_batch=4, max_context=256, prefill_chunk=32, segment_cycles=3, max_queue=16)
    if "draft" in {f.name for f in dataclasses.fields(EngineConfig)}:
        from jaxspec.decoding import DraftShape

        return EngineConfig(draft=DraftShape(num_steps, topk, num_draft_tokens), **shape)
    return EngineConfig(num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens, **shape)  # before


def main() -> None:
    from jaxspec import bundled
    from jaxspec.decoding.sampling_params import RowSpec, Sampling
    from jaxspec.serving.engine import Engine, Request

    target, drafter, tokenizer = bundled.load_pair()
    prompts = [tokenizer.encode(p)[:40] for p in bundled.prompts()]
    settings = [Sampling(), Sampling(0.8, top_k=20), Sampling(1.0, top_p=0.9)]
    for num_steps, topk, tokens in DRAFTS:
        config = engine_config(num_steps, topk, tokens)
        engine = Engine(target, drafter if num_steps else None, config, stop_ids=tokenizer.stop_ids)
        requests = [
            Request(prompts[i % len(prompts)], 24 + i, RowSpec(settings[i % 3], seed=None if i % 3 == 0 else 100 + i))
            for i in range(12)
        ]
        for r in requests:
            engine.submit(r)
        engine.run_until_idle()
        digest = hashlib.sha256(json.dumps([r.tokens for r in requests]).encode()).hexdigest()
        reasons = [r.finish_reason for r in requests]
        print(json.dumps({"draft": [num_steps, topk, tokens], "sha256": digest, "finish_reasons": reasons}), flush=True)


if __name__ == "__main__":
    main()
