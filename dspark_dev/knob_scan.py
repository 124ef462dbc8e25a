"""Where the checkout reads environment variables of ours (``DSPARK_*``, ``VLLM_DSPARK_*``).

Used by :mod:`dspark_dev.knobs` (the "read in" column of docs/knobs.md) and by
tests/unit/repo/test_knobs.py (every name read is registered; the runtime reads only through
``vllm_dspark_pp/envs.py``). What counts:

* Python, by AST: ``os.environ.get(N)``, ``os.environ[N]``, ``os.environ.setdefault(N)``,
  ``os.environ.pop(N)``, ``os.getenv(N)``, ``N in os.environ`` (any ``*.environ`` / ``getenv``),
  where ``N`` is a string literal or a name bound to one at the top of the same file
  (``JOBS_ENV = "DSPARK_..."``); calls of a module-level helper of the file that reads the
  variable its first parameter names (``_env_num("DSPARK_...", 8)``); the same calls written
  inside a string (a child's source, a C stub) by regex;
  and every string literal that is exactly a knob name ("named": a name handed to a helper or
  set for a child). A read whose name is neither literal nor bound to one is recorded as
  ``dynamic`` with the expression.
* Shell, by regex: ``${N...}`` and ``$N`` (reads) and ``N=`` (set for a child).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The folders scanned (the runtime package, the tooling, the tests, benchmarks, tools, CI).
SCANNED = ("vllm_dspark_pp", "dspark_dev", "tests", "benchmarks", "tools", ".ci")
NAME = re.compile(r"^(?:VLLM_)?DSPARK_[A-Z0-9_]*[A-Z0-9]$")  # not a prefix ("DSPARK_GPU_")
_EMBEDDED = re.compile(
    r"(?:getenv|environ\.get|environ\.setdefault|environ\.pop|environ\[)\s*\(?\s*"
    r"[\"']((?:VLLM_)?DSPARK_[A-Z0-9_]+)[\"']"
)
_SH_READ = re.compile(
    r"\$\{((?:VLLM_)?DSPARK_[A-Z0-9_]+)(?::?-([^}$]*)\})?|\$((?:VLLM_)?DSPARK_[A-Z0-9_]+)"
)
_SH_SET = re.compile(r"(?<![\w$])((?:VLLM_)?DSPARK_[A-Z0-9_]+)=")


@dataclass(frozen=True)
class Read:
    name: str
    path: str  # relative to the repository root
    line: int
    defaults: tuple[str, ...] = ()  # the literals of the default at the read site, as text


@dataclass
class Scan:
    reads: list[Read] = field(default_factory=list)
    named: list[Read] = field(default_factory=list)  # literals equal to a knob name; sh "N="
    dynamic: list[str] = field(default_factory=list)  # "path:line: expr" reads of no known name

    def read_names(self) -> set[str]:
        return {r.name for r in self.reads}

    def all_names(self) -> set[str]:
        return self.read_names() | {r.name for r in self.named}

    def files(self, name: str, reads_only: bool = True) -> list[str]:
        rows = self.reads if reads_only else self.reads + self.named
        return sorted({r.path for r in rows if r.name == name})


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _literals(node: ast.AST | None) -> tuple[str, ...]:
    """The literal values a default expression can take (``"40"``, ``"150" if X else "40"``)."""
    if node is None:
        return ()
    return tuple(
        str(n.value)
        for n in ast.walk(node)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, (str, int, float))
        and not isinstance(n.value, bool)
    )


def _bound_strings(tree: ast.AST) -> dict[str, str]:
    """``X = "DSPARK_..."`` at the top of the module: X -> the name."""
    out = {}
    for node in getattr(tree, "body", []):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            value = node.value.value
            if isinstance(value, str) and NAME.match(value):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        out[target.id] = value
    return out


def _environ_read_arg(node: ast.AST) -> ast.AST | None:
    """The name argument of an environment read (``os.environ.get(N)``, ``os.getenv(N)``,
    ``os.environ[N]``, ``N in os.environ``), else None."""
    if isinstance(node, ast.Call):
        func = node.func
        arg0 = node.args[0] if node.args else None
        if isinstance(func, ast.Attribute) and _is_environ(func.value):
            return arg0 if func.attr in ("get", "setdefault", "pop") else None
        if (isinstance(func, ast.Attribute) and func.attr == "getenv") or (
            isinstance(func, ast.Name) and func.id == "getenv"
        ):
            return arg0
    elif isinstance(node, ast.Subscript) and _is_environ(node.value):
        return node.slice if isinstance(node.ctx, ast.Load) else None
    elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
        return node.left
    return None


def _reader_helpers(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Module-level functions that read the variable named by their first parameter
    (``def _env_num(name, default): return int(os.environ.get(name, default))``)."""
    out = {}
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.args.args:
            first = fn.args.args[0].arg
            for node in ast.walk(fn):
                arg = _environ_read_arg(node)
                if isinstance(arg, ast.Name) and arg.id == first:
                    out[fn.name] = fn
    return out


def scan_python(text: str, path: str) -> Scan:
    tree = ast.parse(text)
    bound = _bound_strings(tree)
    helpers = _reader_helpers(tree)
    out = Scan()

    def name_of(node: ast.AST | None) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and node.id in bound:
            return bound[node.id]
        return None

    helper_params = {
        id(node): fn.args.args[0].arg
        for fn in helpers.values()
        for node in ast.walk(fn)
        if _environ_read_arg(node) is not None
    }

    def read(arg: ast.AST | None, line: int, default: ast.AST | None, expr: ast.AST) -> None:
        name = name_of(arg)
        if name is None:
            if not (isinstance(arg, ast.Name) and helper_params.get(id(expr)) == arg.id):
                out.dynamic.append(f"{path}:{line}: {ast.unparse(expr)}")
        elif NAME.match(name):
            out.reads.append(Read(name, path, line, _literals(default)))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            arg0 = node.args[0] if node.args else None
            arg1 = node.args[1] if len(node.args) > 1 else None
            if isinstance(func, ast.Attribute) and _is_environ(func.value):
                if func.attr in ("get", "setdefault", "pop"):
                    read(arg0, node.lineno, arg1 if func.attr != "setdefault" else None, node)
            elif (isinstance(func, ast.Attribute) and func.attr == "getenv") or (
                isinstance(func, ast.Name) and func.id == "getenv"
            ):
                read(arg0, node.lineno, arg1, node)
            elif isinstance(func, ast.Name) and func.id in helpers:
                read(arg0, node.lineno, arg1, node)
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            if isinstance(node.ctx, ast.Load):
                read(node.slice, node.lineno, None, node)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            read(node.left, node.lineno, None, node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if NAME.match(node.value):
                out.named.append(Read(node.value, path, node.lineno))
            elif "environ" in node.value or "getenv" in node.value:
                for m in _EMBEDDED.finditer(node.value):
                    line = node.lineno + node.value.count("\n", 0, m.start())
                    out.reads.append(Read(m.group(1), path, line))
    return out


def scan_shell(text: str, path: str) -> Scan:
    out = Scan()
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in _SH_READ.finditer(line):
            name = m.group(1) or m.group(3)
            default = (m.group(2),) if m.group(1) and m.group(2) else ()
            out.reads.append(Read(name, path, lineno, default))
        for m in _SH_SET.finditer(line):
            out.named.append(Read(m.group(1), path, lineno))
    return out


def _is_shell(path: Path) -> bool:
    if path.suffix == ".sh":
        return True
    if path.suffix:
        return False
    try:
        with path.open("rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"sh" in first


def scan(root: Path = REPO, tops: tuple[str, ...] = SCANNED) -> Scan:
    """Every read and naming of a knob under ``tops`` of ``root`` (paths relative to it)."""
    total = Scan()
    for top in tops:
        base = root / top
        paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in paths:
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(root).as_posix()
            if path.suffix == ".py":
                part = scan_python(path.read_text(), rel)
            elif _is_shell(path):
                part = scan_shell(path.read_text(errors="replace"), rel)
            else:
                continue
            total.reads += part.reads
            total.named += part.named
            total.dynamic += part.dynamic
    return total
