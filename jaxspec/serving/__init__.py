"""Serving, in three parts and one value between them (one engine step is `plan = scheduler.schedule()`,
`result = executor.run(plan)`, `scheduler.update(result)`):

- `scheduler.py` decides, in plain Python (an import contract keeps jax out): the queue, the slots, cancellations,
  admission, prefill chunks, the segment's buckets and program, and the seeds of requests that bring none;
- `plan.py` holds the `StepPlan` (everything the device does in one step) and the `StepResult` it gives back, both
  plain values that serialise, so a plan can be logged, replayed, or sent to the other processes of a server;
- `executor.py` runs a plan: it owns the slots' `LoopState` and the compiled programs, and decides nothing;
- `engine.py` is the thread that steps them, the warm-up and the metrics; `app.py` the OpenAI-compatible HTTP app,
  `metrics.py` the Prometheus metrics, `text.py` / `protocol.py` the streamed text and the request bodies. The
  `jaxspec serve` command is in `jaxspec/cli/serve.py`.
"""
