"""Serving: the slot engine (`engine.py`: admit, per-slot chunked prefill, run segments, evict), the
OpenAI-compatible HTTP app (`app.py`), Prometheus metrics (`metrics.py`) (the `jaxspec serve` command is jaxspec/cli/serve.py)."""
