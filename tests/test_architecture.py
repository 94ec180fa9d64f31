"""The architecture contract: the layers in pyproject.toml ([tool.importlinter]), no import cycles, and no module
importing another module's private (`_x`) names. Checked on the import graph (grimp / import-linter), no imports run."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

from tests.support import lint_imports

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxspec", "sharding", "converters")


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def test_import_contracts_hold():
    run = lint_imports(ROOT / "pyproject.toml")
    assert run.returncode == 0 and "0 broken" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]


def test_layer_contract_catches_an_upward_import(tmp_path):
    """The same contract with two adjacent layers swapped must fail: the rules are not vacuous."""
    text = (ROOT / "pyproject.toml").read_text()
    swapped = text.replace('  "jaxspec.runtime",\n  "jaxspec.models",\n', '  "jaxspec.models",\n  "jaxspec.runtime",\n')
    assert swapped != text, "the layers in pyproject.toml changed: update this test"
    (tmp_path / "pyproject.toml").write_text(swapped)
    run = lint_imports(tmp_path / "pyproject.toml")
    assert run.returncode != 0 and "jaxspec.runtime" in run.stdout and "BROKEN" in run.stdout, run.stdout[-3000:]


def test_no_import_cycles_between_modules(graph):
    """Independent of the layer rules: no module reaches a module that imports it (package __init__ re-exports
    excepted: they import their own children by design)."""
    cycles = []
    for a in sorted(graph.modules):
        for b in sorted(graph.find_modules_directly_imported_by(a)):
            if a.startswith(b + ".") or b.startswith(a + "."):  # a package and its own descendant
                continue
            chain = graph.find_shortest_chain(importer=b, imported=a)
            if chain and not any(x != a and a.startswith(x + ".") for x in chain):
                cycles.append(" -> ".join((a, *chain)))
    assert cycles == []


def _sources():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def test_no_module_imports_private_names_of_another():
    """`from jaxspec.x import _y` (or `import jaxspec._x`) across modules: make the name public or move it."""
    offenders = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
                parts = node.module.split(".") + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                parts = [p for a in node.names if a.name.split(".")[0] in PACKAGES for p in a.name.split(".")]
            else:
                continue
            if any(p.startswith("_") and not p.startswith("__") for p in parts):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {'.'.join(parts)}")
    assert offenders == []


def test_the_checks_see_the_whole_code_base(graph):
    """Guards against an empty graph (wrong root, failed build) making every check above pass trivially."""
    for pkg in PACKAGES:
        files = {p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".") for p in (ROOT / pkg).rglob("*.py")}
        files = {f.removesuffix(".__init__") for f in files}
        assert files <= graph.modules, sorted(files - graph.modules)


MAX_FUNCTION_LINES = 60


def test_no_function_longer_than_60_lines_without_a_reason():
    """A function over 60 lines needs a `# long: <why>` comment on the line above its `def` (or its decorators)."""
    offenders = []
    for path in _sources():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and "# long:" not in lines[first - 2]:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert offenders == []
