"""Serving: the slot engine (`engine.py`: admit, per-slot chunked prefill, run segments, evict), the
OpenAI-compatible HTTP app (`app.py`) and Prometheus metrics (`metrics.py`); the `jaxspec serve` command is in
`jaxspec/cli/serve.py`."""
