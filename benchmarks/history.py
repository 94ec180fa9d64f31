"""Load a module as it was at an older commit (the "before" side of a before/after benchmark), from git history.

The old code runs against today's package for everything it imports, so a benchmark compares one function or class,
not two whole trees. Not kept in the package: history belongs to git.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def source_at(commit: str, path: str) -> str:
    """The text of `path` (relative to the repository root) at `commit`."""
    return subprocess.run(
        ["git", "show", f"{commit}:{path}"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout


def module_at(commit: str, path: str, name: str, *, replace: dict[str, str] | None = None) -> types.ModuleType:
    """Execute `path` as of `commit` as a new module `name` (registered in sys.modules, so later old modules can
    import it); `replace` rewrites its source first (e.g. to point an import at another old module)."""
    text = source_at(commit, path)
    for old, new in (replace or {}).items():
        if old not in text:
            raise ValueError(f"{commit}:{path} does not contain {old!r}")
        text = text.replace(old, new)
    module = types.ModuleType(name)
    module.__file__ = f"{commit}:{path}"
    sys.modules[name] = module
    exec(compile(text, module.__file__, "exec"), module.__dict__)
    return module
