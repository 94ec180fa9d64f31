"""Serving: the slot engine (`engine.py`: admit, per-slot chunked prefill, run segments, evict), the
OpenAI-compatible HTTP app (`app.py`), Prometheus metrics (`metrics.py`) and the `jaxspec serve` command (`cli.py`)."""
