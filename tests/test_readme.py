"""The README is the front page: at most 250 lines, and its first two fenced bash blocks are the commands `.ci/run`
executes from a clean clone: set up and run the bundled pair; set up the tests in ONE command and run them. Its
commands, flags and links are checked with the docs' in tests/test_docs.py."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", flags=re.S | re.M)
VENV = "python3.11 -m venv .venv && . .venv/bin/activate"


def test_readme_is_a_front_page():
    lines = README.count("\n")
    assert lines <= 250, f"README.md has {lines} lines; the reference belongs in docs/"


def test_first_two_bash_blocks_are_what_ci_runs():
    fences = FENCE.findall(README)
    assert [lang for lang, _ in fences[:2]] == ["bash", "bash"], "the README's first two code blocks must be bash"
    install, tests = fences[0][1], fences[1][1]
    assert "pip install -e ." in install and re.search(r"^jaxspec ", install, flags=re.M)
    # A fresh venv, exactly one set-up command, the test command.
    assert tests.splitlines() == [VENV, "python tests/install.py", "python -m pytest -q -n 2"], tests

    # .ci/run builds its script with this embedded Python; run it and compare with the blocks.
    ci = (ROOT / ".ci" / "run").read_text()
    extractor = re.search(r"<<'PY' > \"\$script\"\n(.*?)\nPY\n", ci, flags=re.S).group(1)
    script = subprocess.run(
        [sys.executable, "-c", extractor], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert script == f"echo '=== README block 1 ==='\n{install}\necho '=== README block 2 ==='\n{tests}\n"
    assert "bash -euxo pipefail" in ci  # -x: the log shows each command, the set-up command included


def test_install_script_is_one_command_for_the_whole_environment():
    """tests/install.py: the test, tpu and prompts extras (editable), then speculators without its declared
    torchvision and torchaudio; this environment, made by it, has neither of those two."""
    from tests import install

    assert install.pip_commands() == [
        ["-m", "pip", "install", "-e", ".[test,tpu,prompts]"],
        ["-m", "pip", "install", "--no-deps", "speculators==0.9.0"],
    ]
    assert install.breaking_packages() == []
