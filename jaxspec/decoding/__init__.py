"""Speculative decoding: sampling, the accept rules, and the jitted draft-verify loop."""
