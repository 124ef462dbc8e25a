"""Docs that cannot drift: every repository path and project module that README.md and
docs/**/*.md name exists, and docs/architecture.md names every runtime module.

What counts as a name (see :func:`named_paths` and :func:`named_modules`):

* a relative markdown link target (``[text](docs/x.md#anchor)``), resolved from the page's folder;
* a path that starts with a top-level folder of the repository (``vllm_dspark_pp/``,
  ``dspark_dev/``, ``tests/``, ``tools/``, ``benchmarks/``, ``docs/``, ``models/tiny-pair/``,
  ``.ci/``) or with a runtime subpackage (``patches/``, ``protocol/``, ``producer/``, ``cli/``:
  under ``vllm_dspark_pp/``; only when it ends in ``.py`` or ``/``), in or out of backticks;
  ``{a,b}`` alternatives are expanded, a trailing ``::name`` or ``:line`` is dropped, and paths
  with placeholders (``*``, ``$``, ``<``, ``X`` alone as a segment) are skipped;
* a dotted module name under ``vllm_dspark_pp``, ``dspark_dev`` or ``support`` (tests/support),
  or a path that ends in one (``dspark_dev/serve.wait_ready``): its longest module prefix
  must exist, and what follows (one attribute) must be defined there.

Not checked: what a command writes (the path after ``--out``, ``--png``, ``--md``, ``--json``,
``--out-json``, ``--results-md``, ``--log``), and text between ``<!-- historic -->`` and
``<!-- /historic -->`` (names as they were: a rename map, removed tests, dated run records).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
RUNTIME = REPO / "vllm_dspark_pp"
TOP = ("vllm_dspark_pp", "dspark_dev", "tests", "tools", "benchmarks", "docs", ".ci")
TOP += ("models/tiny-pair",)  # not "models/": the pages cite vLLM's models/<family>/ sources
RUNTIME_SUBPACKAGES = ("patches", "protocol", "producer", "cli")
PACKAGE_ROOTS = {"vllm_dspark_pp": REPO, "dspark_dev": REPO, "support": REPO / "tests"}

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATH = re.compile(
    r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP + RUNTIME_SUBPACKAGES) + r")"
    r"/[\w.{},*$<>/-]*)"
)
_MODULE = re.compile(r"(?<![\w./-])((?:vllm_dspark_pp|dspark_dev|support)(?:\.\w+)+)")
_PLACEHOLDER = re.compile(r"[*$<>]|(^|/)(X|N|NAME|PAIR|DIR|OUT)(/|\.|$)")
_WRITTEN = re.compile(r"--(?:out|png|md|json|out-json|results-md|log)[ =]\S+")
_HISTORIC = re.compile(r"<!-- historic -->.*?<!-- /historic -->", re.S)


def checked_text(page: Path) -> str:
    """The page without its historic regions and the paths its commands write."""
    return _WRITTEN.sub("", _HISTORIC.sub("", page.read_text()))


def doc_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _expand(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    out = []
    for alt in m.group(1).split(","):
        out += _expand(path[: m.start()] + alt + path[m.end() :])
    return out


def named_paths(page: Path, text: str) -> list[tuple[str, Path]]:
    """(as written, the file or folder it names) for each path the page names."""
    found = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        target = target.split("#")[0]
        if target:
            found.append((target, (page.parent / target).resolve()))
    for raw in _PATH.findall(text):
        raw = re.split(r"::|:\d", raw)[0].rstrip(".,")
        for path in _expand(raw):
            if _PLACEHOLDER.search(path):
                continue
            first = path.split("/")[0]
            if first in RUNTIME_SUBPACKAGES and not path.endswith((".py", "/")):
                continue  # "producer/on": a word pair, not a path
            base = RUNTIME if first in RUNTIME_SUBPACKAGES else REPO
            found.append((path, base / path))
    return found


def path_problem(path: Path) -> str | None:
    """None when ``path`` exists or is ``module.attribute`` of a module that defines it."""
    if path.exists():
        return None
    module, _, attr = path.name.partition(".")
    source = path.with_name(module + ".py")
    if attr.isidentifier() and source.is_file() and _defines(source, attr):
        return None
    return "missing"


def _defines(source: Path, name: str) -> bool:
    tree = ast.parse(source.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                return True
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
    return False


def module_problem(dotted: str) -> str | None:
    """Why ``dotted`` names no module (or attribute of one) of the project; None when it does."""
    parts = dotted.split(".")
    root = PACKAGE_ROOTS[parts[0]]
    for i in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:i])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if base.is_dir() and not source.is_file():  # a namespace package (no __init__.py)
            rest = parts[i:]
            return None if not rest else f"{'.'.join(parts[:i])} has no module {rest[0]}"
        if source.is_file():
            rest = parts[i:]
            if not rest:
                return None
            if len(rest) == 1 and _defines(source, rest[0]):
                return None
            return f"{'.'.join(parts[:i])} defines no {'.'.join(rest)}"
    return "no such module"


def named_modules(text: str) -> list[str]:
    return sorted(set(_MODULE.findall(text)))


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO))


@pytest.mark.parametrize("page", doc_pages(), ids=_rel)
def test_every_path_a_page_names_exists(page):
    text = checked_text(page)
    missing = sorted({shown for shown, path in named_paths(page, text) if path_problem(path)})
    assert not missing, f"{_rel(page)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", doc_pages(), ids=_rel)
def test_every_module_a_page_names_exists(page):
    problems = [
        f"{m}: {why}"
        for m in named_modules(checked_text(page))
        if (why := module_problem(m)) is not None
    ]
    assert not problems, f"{_rel(page)} names modules that do not exist: {problems}"


def runtime_modules() -> list[Path]:
    return sorted(p for p in RUNTIME.rglob("*.py") if p.name != "__init__.py")


def test_the_architecture_page_names_every_runtime_module():
    """By file name (``schedule.py``), or by its path in the package (``cli/plan.py``) where two
    modules share a file name; patch modules by name alone (the picture shows them so)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    flat = "".join(text.replace("|", "").split())  # names may be wrapped in the picture
    names = [p.name for p in runtime_modules()]
    missing = []
    for path in runtime_modules():
        rel = path.relative_to(RUNTIME)
        if rel.parts[0] == "patches" and not rel.stem.startswith("_"):
            shown = rel.stem in flat
        elif names.count(path.name) > 1:
            shown = re.search(rf"(?<![\w/]){re.escape(rel.as_posix())}", text) is not None
        else:
            shown = re.search(rf"(?<![\w.]){re.escape(path.name)}", text) is not None
        if not shown:
            missing.append(rel.as_posix())
    assert not missing, f"docs/architecture.md does not name these runtime modules: {missing}"


def test_the_checks_catch_a_stale_path_and_module(tmp_path):
    """A planted stale path, link and module are reported; real ones are not."""
    page = REPO / "docs" / "planted.md"
    text = (
        "See `vllm_dspark_pp/graph_batch.py` and [x](results/gone.md), not "
        "`vllm_dspark_pp/protocol/graph_batch.py` or [y](patches.md#top); "
        "`vllm_dspark_pp.protocol.graph_batch.no_such_name`, `dspark_dev.gone`, "
        "`vllm_dspark_pp.protocol.handler.dspark_pp_handler_class`, "
        "tools/{quickstart,run_tests}.sh, "
        "dspark_dev/serve.wait_ready and dspark_dev/serve.no_such_function; "
        "`vllm_dspark_pp.producer` and `vllm_dspark_pp.producer.gone`."
    )
    missing = {shown for shown, path in named_paths(page, text) if path_problem(path)}
    assert missing == {
        "vllm_dspark_pp/graph_batch.py",
        "results/gone.md",
        "dspark_dev/serve.no_such_function",
    }
    bad = {m for m in named_modules(text) if module_problem(m)}
    assert bad == {
        "vllm_dspark_pp.protocol.graph_batch.no_such_name",
        "dspark_dev.gone",
        "vllm_dspark_pp.producer.gone",
    }
