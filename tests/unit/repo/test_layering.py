"""The package's layers: imports only point down, no cycles, no test or dev code at run time.

Layers (top to bottom): ``cli`` > ``patches`` > the features (``protocol``, ``producer``,
``connectors``, ``sync_drafts``, ``deployment_plan``, ``stage_balance``) > ``version`` /
``cpu_ops``. The development package ``dspark_dev`` (at the repository root, not in the wheel)
may import the runtime, never the other way round. Every import counts, including those inside
functions; there is no exemption. Imports by name count too: ``importlib.import_module("a.b")``
with a literal name, and the ``"vllm_dspark_pp.a.b:attribute"`` names that a registry resolves
later (the draft families of ``producer/families.py``, as vLLM's model registry does).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from support.wheel import wheel_packages

PKG = Path(__file__).resolve().parents[3] / "vllm_dspark_pp"
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
#: A lazily resolved ``"module:attribute"`` name of a module of the package.
LAZY_NAME = re.compile(r"^(vllm_dspark_pp(?:\.\w+)*):\w+$")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _named_import(node: ast.AST) -> str | None:
    """The module a call ``import_module("a.b")`` / ``importlib.import_module("a.b")`` names with
    a literal, or a ``"vllm_dspark_pp.a.b:attribute"`` string names (None: neither)."""
    if isinstance(node, ast.Call) and node.args:
        func, arg = node.func, node.args[0]
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called == "import_module" and isinstance(arg, ast.Constant):
            if isinstance(arg.value, str) and not arg.value.startswith("."):
                return arg.value
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        m = LAZY_NAME.match(node.value)
        if m:
            return m.group(1)
    return None


def _imports(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        named = _named_import(node)
        if named is not None:
            found.add(named)
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


def test_imports_by_name_are_followed(tmp_path):
    """The graph sees a literal ``import_module`` and a registry's ``"module:attribute"`` names
    (a planted module of each kind), so a lazy import cannot hide a cycle or a layer breach."""
    code = (
        "import importlib\n"
        "from importlib import import_module\n"
        "def f(name):\n"
        "    importlib.import_module('vllm_dspark_pp.a')\n"
        "    import_module('vllm_dspark_pp.b')\n"
        "    importlib.import_module(name)\n"
        "    return ('vllm_dspark_pp.c.d:Klass', 'not.a:name', 'vllm_dspark_pp.e', 'x:y:z')\n"
    )
    planted = tmp_path / "planted.py"
    planted.write_text(code)
    lazy = {m for m in _imports(planted, "planted") if m.startswith("vllm_dspark_pp")}
    assert lazy == {"vllm_dspark_pp.a", "vllm_dspark_pp.b", "vllm_dspark_pp.c.d"}


def test_family_modules_import_only_the_shared_modules_and_nothing_imports_the_registry_back():
    """A draft family is one module of top-level classes over ``producer/drafter.py`` (the
    shared base) and ``producer/memory.py`` (the memory rules), named by the registry
    ``producer/families.py``. The registry imports nothing of the project when it is imported
    and names (lazily) only family modules and those two; neither they nor any family module
    import the registry, so no lazy import closes a circle through it."""
    from vllm_dspark_pp.producer import families

    graph = _graph()
    producer = "vllm_dspark_pp.producer"
    shared = {f"{producer}.drafter", f"{producer}.memory"}
    named = {
        ref.partition(":")[0]
        for f in families.FAMILIES
        for ref in (f.context_kv, f.memory, *f.checks)
        if ref is not None
    }
    family_modules = named - shared
    assert family_modules, "the registry names no family module"
    for fam in family_modules:
        targets = {t for t in graph[fam] if ".producer." in t}
        assert targets <= shared, (fam, targets)
    assert graph[f"{producer}.families"] == named
    tree = ast.parse((PKG / "producer" / "families.py").read_text())
    top_imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [n for n in top_imports if "vllm_dspark_pp" in ast.unparse(n)]
    for module in shared:
        assert not {t for t in graph[module] if ".producer." in t} - shared, module
    back = [m for m, targets in graph.items() if f"{producer}.families" in targets]
    assert not set(back) & (named | shared), back


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
