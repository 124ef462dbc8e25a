"""No Python file of the repository edits the import path: the checkout's code is found because
`python -m` runs from the checkout root, pytest's `pythonpath` or a child's `PYTHONPATH`
(docs/contributing.md), never by a ``sys.path`` insert."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
MUTATORS = {"insert", "append", "extend", "remove", "pop", "clear"}
# folders that hold no file of the repository (environments, build output, caches)
SKIPPED = {"build", "__pycache__", "node_modules"}
#: a path edit spelled inside a string (the code of a child process)
STRING_EDIT = re.compile(
    r"\bsys\.path\s*(\[[^\]\n]*\]\s*)?\+?=(?!=)"
    r"|\bsys\.path\.(insert|append|extend|remove|pop|clear)\("
    r"|\bsite\.addsitedir\("
)


def _is_sys_path(node: ast.AST, path_names: set[str]) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "path":
        return isinstance(node.value, ast.Name) and node.value.id == "sys"
    return isinstance(node, ast.Name) and node.id in path_names


def path_edits(source: str, filename: str = "<source>") -> list[str]:
    """``line: code`` of every statement in ``source`` that changes ``sys.path`` (a call of one
    of its mutating methods, an assignment, augmented assignment or deletion of it or a slice of
    it) or calls ``site.addsitedir``."""
    tree = ast.parse(source, filename)
    path_names = {  # `from sys import path [as p]`
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "sys"
        for alias in node.names
        if alias.name == "path"
    }

    def target(node: ast.AST) -> bool:
        if isinstance(node, ast.Subscript):
            node = node.value
        return _is_sys_path(node, path_names)

    found = []
    for node in ast.walk(tree):
        hit = False
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            # a child script passed as a string (``python -c``): its path edits count too
            hit = bool(STRING_EDIT.search(node.value))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            hit = (f.attr in MUTATORS and _is_sys_path(f.value, path_names)) or (
                f.attr == "addsitedir" and isinstance(f.value, ast.Name) and f.value.id == "site"
            )
        elif isinstance(node, ast.Assign):
            hit = any(target(t) for t in node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            hit = target(node.target)
        elif isinstance(node, ast.Delete):
            hit = any(target(t) for t in node.targets)
        if hit:
            found.append(f"{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def python_files(root: Path) -> list[Path]:
    """Every ``*.py`` under ``root`` outside hidden folders (.venv, .git) and build output; those
    folders are pruned, not walked (the venv alone held about 14 s of walking)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED]
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found)


def test_no_file_of_the_repository_edits_sys_path():
    files = python_files(REPO)
    assert REPO / "benchmarks" / "perf_real_shapes.py" in files  # the walk sees the tooling
    bad = {
        str(p.relative_to(REPO)): edits
        for p in files
        if p != Path(__file__).resolve()  # this file's planted spellings
        and (edits := path_edits(p.read_text(), str(p)))
    }
    assert not bad, bad


@pytest.mark.parametrize(
    "planted",
    [
        "import sys\nsys.path.insert(0, 'x')\n",
        "import sys\nsys.path.append('x')\n",
        "import sys\nsys.path[:0] = ['x']\n",
        "import sys\nsys.path += ['x']\n",
        "import sys\ndel sys.path[0]\n",
        "import sys\nsys.path = ['x']\n",
        "from sys import path\npath.insert(0, 'x')\n",
        "import site\nsite.addsitedir('x')\n",
        "def f():\n    import sys\n    if 'x' not in sys.path:\n        sys.path.insert(0, 'x')\n",
        # a child script in a string (tests/unit/producer/test_dsv41_pp_relay.py had one)
        'CODE = """\nimport sys\nsys.path[:0] = [{repo!r}]\n"""\n',
        "CODE = 'import sys; sys.path.insert(0, \"x\")'\n",
    ],
)
def test_each_spelling_of_a_path_edit_is_found(planted):
    assert path_edits(planted)


def test_reading_sys_path_is_not_an_edit():
    source = "import sys\nfor entry in sys.path:\n    print(entry, sys.path[0], len(sys.path))\n"
    assert path_edits(source) == []
    assert path_edits('DOC = "no file edits ``sys.path``; sys.path[0] == x"\n') == []
