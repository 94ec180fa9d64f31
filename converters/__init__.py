"""Checkpoint converters (`jaxspec-convert`): HF safetensors -> sharded Orbax, drafters both ways.

The HF name table and the lazy safetensors reader they build on live in `jaxspec.io.hf`, the compressed-tensors
INT4 codec in `jaxspec.io.compressed_tensors`; this package adds streaming, resumable conversion on top.
"""
