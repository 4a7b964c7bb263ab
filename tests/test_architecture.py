"""The module chain of docs/ARCHITECTURE.md holds: every module is named, none imports a later one.

Imports are read from the source (ast), so one inside a function counts as
much as one at the top: a lazy import against the chain is still a module
that needs a later one to work.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "momlab"


def chain(text: str) -> dict[str, int]:
    """Rank of each module named in the first fenced block of ARCHITECTURE.md (names before the first
    run of two spaces on a line; a continuation line starts with spaces and names nothing)."""
    block = text.split("```")[1]
    rank = {}
    for line in block.splitlines():
        m = re.match(r"^([a-z_][a-z_/ ,]*?)\s{2,}\S", line)
        if not m:
            continue
        names = [n.strip().rstrip("/") for n in re.split(r"[,/]|\s+", m.group(1)) if n.strip()]
        line_rank = len(set(rank.values()))
        for n in names:
            rank[n] = line_rank
    return rank


def top_module(path: Path) -> str:
    """momlab/x.py -> x; momlab/moms/y.py -> moms (a package is one room of the chain)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top module of momlab) of every import of momlab code in `tree`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mod = node.module.split(".")
            if mod[0] != "momlab":
                continue
            if len(mod) > 1:
                out.append((node.lineno, mod[1]))
            else:  # from momlab import x, y: modules (or __version__, the package's own)
                out += [(node.lineno, a.name) for a in node.names if a.name != "__version__"]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[1]) for a in node.names if a.name.startswith("momlab.")]
    return out


def violations(rank: dict[str, int], files) -> tuple[list[str], list[str]]:
    unnamed, later = [], []
    for path in files:
        name = top_module(path)
        if name == "__init__":  # the package's re-exports: the public API, above the chain
            continue
        if name not in rank:
            unnamed.append(name)
            continue
        for line, target in imported(ast.parse(path.read_text())):
            if target not in rank:
                unnamed.append(f"{target} (imported by {path.relative_to(ROOT)}:{line})")
            elif rank[target] > rank[name]:
                later.append(f"{path.relative_to(ROOT)}:{line}: {name} imports {target}, later in the chain")
    return sorted(set(unnamed)), later


def test_every_module_is_named_and_none_imports_a_later_one():
    rank = chain((ROOT / "docs" / "ARCHITECTURE.md").read_text())
    unnamed, later = violations(rank, sorted(PACKAGE.rglob("*.py")))
    assert not unnamed, f"modules missing from docs/ARCHITECTURE.md's chain: {unnamed}"
    assert not later, "imports against the chain:\n" + "\n".join(later)


def test_the_check_catches_an_import_against_the_chain(tmp_path):
    """The walker is not vacuous: a lazy import of a later module, and an unnamed module, are reported."""
    rank = chain("```\nerrors, units       leaves\nmeasure        one\ncli / __main__     last\n```")
    assert rank == {"errors": 0, "units": 0, "measure": 1, "cli": 2, "__main__": 2}
    pkg = tmp_path / "momlab"
    pkg.mkdir()
    (pkg / "measure.py").write_text("def f():\n    from momlab.cli import main\n")
    (pkg / "stray.py").write_text("from momlab import errors\n")
    global PACKAGE, ROOT
    saved = PACKAGE, ROOT
    PACKAGE, ROOT = pkg, tmp_path
    try:
        unnamed, later = violations(rank, sorted(pkg.rglob("*.py")))
    finally:
        PACKAGE, ROOT = saved
    assert unnamed == ["stray"]
    assert later == ["momlab/measure.py:2: measure imports cli, later in the chain"]


@pytest.mark.parametrize("module", ["estimate", "distributed", "sweep", "launch", "figures", "search"])
def test_only_cli_parses_argv(module):
    """All argparse lives in momlab/cli.py (issue 12): no other module declares flags."""
    source = (PACKAGE / f"{module}.py").read_text()
    assert "argparse" not in source and "add_argument" not in source
