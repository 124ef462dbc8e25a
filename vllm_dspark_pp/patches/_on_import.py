"""Apply a patch when its target module is imported, not before.

``apply()`` runs in every process, the API server included, where importing vLLM's GPU worker
modules (model runner, Triton kernels) would cost seconds and memory for nothing. A patch that
calls :func:`when_imported` patches its target at once if it is already imported, and otherwise
right after the module body has run, before any importer of the module can bind its names
(``from vllm.v1.worker.gpu.warmup import warmup_kernels`` then binds the patched function).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType

_lock = threading.Lock()
_pending: dict[str, list[Callable[[ModuleType], None]]] = {}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec):  # noqa: D102
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        with _lock:
            callbacks = _pending.pop(self._name, [])
        for cb in callbacks:
            cb(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _Loader):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


_finder = _Finder()


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Run ``callback(module)`` now if ``module_name`` is imported, else right after its import."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    with _lock:
        _pending.setdefault(module_name, []).append(callback)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
