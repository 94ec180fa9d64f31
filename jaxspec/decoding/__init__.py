"""Speculative decoding: the draft shape, sampling, the accept rules, and the jitted draft-verify loop."""

from jaxspec.decoding.draft_shape import DraftShape

__all__ = ["DraftShape"]
