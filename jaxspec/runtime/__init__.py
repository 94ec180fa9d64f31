"""Runtime objects: a model's weights on a mesh and its compiled entry points. No file I/O (see `jaxspec.io`)."""

from jaxspec.runtime.drafter import Drafter
from jaxspec.runtime.target import ABSORBED_MAX_TOKENS, Head, Target, check_mesh

__all__ = ["ABSORBED_MAX_TOKENS", "Drafter", "Head", "Target", "check_mesh"]
