"""The package's layers: imports only point down, no cycles, no test or dev code at run time.

Layers (top to bottom): ``cli`` > ``patches`` > the features (``protocol``, ``producer``,
``connectors``, ``sync_drafts``, ``deployment_plan``, ``stage_balance``) > ``version`` /
``cpu_ops``. The development package ``dspark_dev`` (at the repository root, not in the wheel)
may import the runtime, never the other way round. Every import counts, including those inside
functions; there is no exemption.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.wheel import wheel_packages

PKG = Path(__file__).resolve().parents[2] / "vllm_dspark_pp"
FEATURES = (
    "protocol",
    "producer",
    "connectors",
    "sync_drafts",
    "deployment_plan",
    "stage_balance",
    "start_checks",
)
FORBIDDEN_AT_RUNTIME = ("tests", "support", "tools", "benchmarks", "dspark_dev")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        targets = set()
        for imp in _imports(path, name):
            # the longest known module that the import names
            parts = imp.split(".")
            for i in range(len(parts), 0, -1):
                cand = ".".join(parts[:i])
                if cand in mods and cand != name:
                    targets.add(cand)
                    break
        graph[name] = targets
    return graph


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_runtime_never_imports_tests_tools_benchmarks_or_dev():
    bad = [
        f"{name} imports {imp}"
        for name, path in _modules().items()
        for imp in _imports(path, name)
        if imp.split(".")[0] in FORBIDDEN_AT_RUNTIME
    ]
    assert not bad, bad


def test_the_wheel_holds_the_runtime_package_only():
    """Every package of the wheel is ``vllm_dspark_pp`` or below it, none of them is development
    tooling, and the development package exists beside it (in the checkout)."""
    runtime = sorted({".".join(p.parent.relative_to(PKG.parent).parts) for p in PKG.rglob("*.py")})
    assert wheel_packages() == runtime
    assert not [p for p in runtime if p.split(".")[-1] in ("dev", "training", "commands")]
    assert (PKG.parent / "dspark_dev" / "__init__.py").is_file()


def test_features_do_not_import_patches_or_cli():
    bad = [
        f"{m} -> {t}"
        for m, targets in _graph().items()
        if _layer(m) in FEATURES
        for t in targets
        if _layer(t) in ("patches", "cli")
    ]
    assert not bad, bad


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if t == "vllm_dspark_pp" or m == "vllm_dspark_pp":
                continue  # the package root (register) is the entry point, above everything
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t) :] + [t] if t in stack else [m, t])
            elif state.get(t) is None:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if state.get(m) is None:
            visit(m, [m])
    assert not cycles, cycles


def test_family_modules_import_only_the_shared_base_and_the_registry():
    """A draft family is one module over ``producer/drafter.py`` that registers itself in
    ``producer/families.py``; the registry imports nothing of the project (every layer reads
    it), and the shared base no family module."""
    from vllm_dspark_pp.producer.families import NOT_FAMILIES

    graph = _graph()
    producer = "vllm_dspark_pp.producer"
    modules = {p.stem for p in (PKG / "producer").glob("*.py")} - {"__init__", *NOT_FAMILIES}
    assert modules, "no family module found"
    for fam in modules:
        targets = {t for t in graph[f"{producer}.{fam}"] if ".producer." in t}
        assert targets <= {f"{producer}.drafter", f"{producer}.families"}, (fam, targets)
    assert not {t for t in graph[f"{producer}.drafter"] if ".producer." in t} - {
        f"{producer}.families"
    }
    assert not {t for t in graph[f"{producer}.families"] if t.startswith("vllm_dspark_pp")}


def test_the_package_defines_no_triton_kernel():
    """The plugin owns no GPU kernel (it calls vLLM's): a Triton kernel added here would need its
    own reference test on the GPU tier (replaces the GPU test of a `kernels/` package that never
    existed, whose only non-vacuous check was this one)."""
    import re

    jit = re.compile(r"@\s*triton\.jit|@\s*tl\.jit|triton\.jit\(")
    found = [str(p) for p in PKG.rglob("*.py") if jit.search(p.read_text(errors="replace"))]
    assert not found, f"Triton kernels in the package (add a GPU reference test): {found}"


def test_the_architecture_page_names_every_patch():
    """docs/architecture.md's picture shows where each patch points: none may be missing."""
    text = (PKG.parent / "docs" / "architecture.md").read_text()
    flat = "".join(text.split())  # names may be wrapped across lines of the picture
    flat = flat.replace("|", "")
    names = [p.stem for p in (PKG / "patches").glob("*.py") if not p.stem.startswith("_")]
    missing = [n for n in names if n not in flat]
    assert not missing, f"docs/architecture.md does not show these patches: {missing}"


def test_code_outside_the_package_hooks_vllm_through_the_public_name():
    """Benchmarks, tools, tests and the development package wait for a vLLM module through
    ``vllm_dspark_pp.patches.when_imported``, never the private module that implements it."""
    private = "patches." + "_on_import"  # split: this file must not match itself
    root = PKG.parent
    found = [
        str(path.relative_to(root))
        for top in ("benchmarks", "dspark_dev", "tests", "tools")
        for path in (root / top).rglob("*.py")
        if private in path.read_text(errors="replace")
    ]
    assert not found, f"import vllm_dspark_pp.patches.when_imported instead: {found}"
