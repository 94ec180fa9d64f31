"""Flax NNX modules: the Kimi/DeepSeek-V3 target (`kimi`) and its building blocks."""
