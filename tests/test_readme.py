"""The README's commands exist: every `jaxspec`, `jaxspec-convert` and `demos/multi_gpu.py` command line in its code
blocks parses with the real argument parsers, every flag named in a command's section exists, and the first two
fenced bash blocks are the set-up commands `.ci/run` executes."""

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from converters.__main__ import build_parser as convert_parser
from jaxspec.cli import build_parser as jaxspec_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", flags=re.S | re.M)


def multi_gpu_parser() -> argparse.ArgumentParser:
    spec = importlib.util.spec_from_file_location("demos_multi_gpu", ROOT / "demos" / "multi_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


PARSERS = {"jaxspec": jaxspec_parser, "jaxspec-convert": convert_parser, "multi_gpu": multi_gpu_parser}


def command_lines() -> list[tuple[str, list[str]]]:
    """(parser name, argv) of every command line in the README's code blocks (continuations joined)."""
    found = []
    for _, body in FENCE.findall(README):
        for line in body.replace("\\\n", " ").splitlines():
            if not line.startswith(("jaxspec", "python -m jaxspec", "python demos/")):
                continue
            words = shlex.split(line, comments=True)
            if words[:1] in (["jaxspec"], ["jaxspec-convert"]):
                found.append((words[0], words[1:]))
            elif words[:3] == ["python", "-m", "jaxspec"]:
                found.append(("jaxspec", words[3:]))
            elif words[:2] == ["python", "demos/multi_gpu.py"]:
                found.append(("multi_gpu", words[2:]))
    return found


COMMANDS = command_lines()


def _strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """No abbreviated flags: `--prompt` must not pass for `--prompts-file`."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _strict(sub)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    parser = _strict(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{parser.prog} {shlex.join(argv)}: does not parse:\n{err.getvalue()}")


def test_readme_documents_every_subcommand():
    documented = set()
    for name, argv in COMMANDS:
        if name != "multi_gpu":
            with contextlib.suppress(SystemExit), contextlib.redirect_stderr(io.StringIO()):
                documented.add((name, PARSERS[name]().parse_args(argv).command))
    for name in ("jaxspec", "jaxspec-convert"):
        for sub in _subparsers(PARSERS[name]()):
            assert (name, sub) in documented, f"no `{name} {sub}` example in the README's code blocks"
    assert any(name == "multi_gpu" for name, _ in COMMANDS), "no demos/multi_gpu.py example in the README"


@pytest.mark.parametrize(("name", "argv"), COMMANDS, ids=[f"{n} {' '.join(a)}"[:80] for n, a in COMMANDS])
def test_readme_command_parses(name, argv):
    _parse(PARSERS[name](), argv)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _sections() -> list[tuple[str, str]]:
    """(heading, text) of every `##`/`###` section."""
    parts = re.split(r"^(#{2,3} .*)$", README, flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def test_flags_named_in_command_sections_exist():
    """A `--flag` in the prose of a section titled after commands belongs to one of them (or is global)."""
    jaxspec, convert = jaxspec_parser(), convert_parser()
    subs = {f"jaxspec {k}": v for k, v in _subparsers(jaxspec).items()}
    subs |= {f"jaxspec-convert {k}": v for k, v in _subparsers(convert).items()}
    checked = 0
    for heading, text in _sections():
        commands = [c for c in subs if re.search(rf"`{re.escape(c)}`", heading)]
        if not commands:
            continue
        allowed = _flags(jaxspec) | _flags(convert) | set().union(*(_flags(subs[c]) for c in commands))
        prose = FENCE.sub("", text)
        for span in re.findall(r"`(--[a-z0-9-]+)", prose):
            assert span in allowed, f"{heading}: {span} is not a flag of {', '.join(commands)}"
            checked += 1
    assert checked >= 5  # the sections do name flags; an empty scan would prove nothing


def test_first_two_bash_blocks_are_what_ci_runs():
    fences = FENCE.findall(README)
    assert [lang for lang, _ in fences[:2]] == ["bash", "bash"], "the README's first two code blocks must be bash"
    install, tests = fences[0][1], fences[1][1]
    assert "pip install -e ." in install and re.search(r"^jaxspec ", install, flags=re.M)
    assert "pip install -e '.[test]'" in tests and "python -m pytest" in tests

    # .ci/run builds its script with this embedded Python; run it and compare with the blocks.
    ci = (ROOT / ".ci" / "run").read_text()
    extractor = re.search(r"<<'PY' > \"\$script\"\n(.*?)\nPY\n", ci, flags=re.S).group(1)
    script = subprocess.run(
        [sys.executable, "-c", extractor], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert script == f"echo '=== README block 1 ==='\n{install}\necho '=== README block 2 ==='\n{tests}\n"
