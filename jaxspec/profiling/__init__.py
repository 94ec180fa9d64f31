"""Profiling: per-phase timing, the step-count cost model, and the draft-depth tuner (`jaxspec tune`)."""

from jaxspec.profiling.cost_model import CostModel, conditional_acceptance, expected_tokens, explain_gap

__all__ = ["CostModel", "conditional_acceptance", "expected_tokens", "explain_gap"]
