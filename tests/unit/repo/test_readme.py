"""The README stays a five-minute read (issue 43): under 1,500 words, the quick start's two
commands first, and a supported matrix of one-line rows, each linking its evidence.

A matrix row is ``| what | status | tier | [evidence](docs/results/x.md) |``:

* no cell over :data:`MAX_CELL` characters (the detail lives in the evidence page);
* the last cell links at least one evidence file, and every linked file exists (the path rules
  and helpers are tests/unit/repo/test_docs_paths.py's);
* a row that names a GPU tier (:data:`GPU_TIER`) links a page or JSON record under
  ``docs/results/``, where each GPU figure's run (date, commit, GPU, command) is recorded.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_docs_paths import REPO, named_paths, path_problem

README = REPO / "README.md"
RESULTS = REPO / "docs" / "results"
MAX_WORDS = 1500
MAX_CELL = 200
MATRIX_HEADING = "## Supported matrix"
HEADER = ["what", "status", "tier", "evidence"]
GPU_TIER = re.compile(r"\bH[12]00\b|\bone GPU\b|\bseveral GPUs\b|\btwo GPUs\b", re.I)
RECORDS = (".md", ".json")
FIRST_COMMANDS = ["bash tools/quickstart.sh", "bash tools/run_tests.sh"]


def words(text: str) -> int:
    """What ``wc -w`` counts."""
    return len(text.split())


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def matrix(text: str) -> tuple[list[str], list[list[str]]]:
    """The header and the rows of the first table after the matrix heading."""
    section = text.split(MATRIX_HEADING, 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    assert len(lines) >= 3, "the matrix has a header, a separator and rows"
    return _cells(lines[0]), [_cells(ln) for ln in lines[2:]]


def row_problems(page: Path, header: list[str], rows: list[list[str]]) -> list[str]:
    """Each rule a row breaks, as ``what: problem``."""
    problems = []
    if header != HEADER:
        problems.append(f"header {header}: want {HEADER}")
    for row in rows:
        name = row[0][:60]
        if len(row) != len(HEADER):
            problems.append(f"{name}: {len(row)} cells, want {len(HEADER)}")
            continue
        problems += [
            f"{name}: a cell of {len(c)} characters (at most {MAX_CELL})"
            for c in row
            if len(c) > MAX_CELL
        ]
        linked = named_paths(page, row[-1])
        if not linked:
            problems.append(f"{name}: links no evidence")
        missing = sorted({shown for shown, path in linked if path_problem(path)})
        problems += [f"{name}: evidence {shown} is missing" for shown in missing]
        records = [p for _, p in linked if p.is_relative_to(RESULTS) and p.suffix in RECORDS]
        if GPU_TIER.search(" ".join(row[:-1])) and not records:
            problems.append(f"{name}: names a GPU tier but links no docs/results page or JSON")
    return problems


def fenced_commands(text: str) -> list[str]:
    """The first line of each fenced ``bash`` block, in order."""
    return [m.strip() for m in re.findall(r"```bash\n\s*([^\n]*)", text)]


def test_the_readme_is_under_1500_words():
    n = words(README.read_text())
    assert n < MAX_WORDS, f"README.md has {n} words; move detail to docs/ (at most {MAX_WORDS})"


def test_every_matrix_row_is_one_short_line_with_its_evidence():
    header, rows = matrix(README.read_text())
    assert len(rows) >= 20  # the rows are read at all
    problems = row_problems(README, header, rows)
    assert not problems, "README matrix rows:\n" + "\n".join(problems)


def test_the_first_two_commands_are_the_quick_start_and_the_tests():
    assert fenced_commands(README.read_text())[:2] == FIRST_COMMANDS


def test_the_checks_catch_a_planted_row_of_each_kind():
    rows = [
        ["ok", "supported", "one H200", "[e](docs/results/gpu.md)"],
        ["long", "x" * (MAX_CELL + 1), "CPU (CI)", "[e](docs/patches.md)"],
        ["no link", "supported", "CPU (CI)", "docs"],
        ["gpu, docs page only", "supported", "one GPU", "[e](docs/protocol.md)"],
        ["gone", "supported", "CPU (CI)", "[e](docs/results/gone.json)"],
        ["three cells", "supported", "[e](docs/results/gpu.md)"],
    ]
    got = row_problems(README, HEADER, rows)
    assert [p.split(":")[0] for p in got] == [
        "long",
        "no link",
        "gpu, docs page only",
        "gone",
        "three cells",
    ]
    assert row_problems(README, ["what", "status"], []) != []
    assert words("one two  three\nfour") == 4
