"""Helpers shared by patch modules: idempotent, composable attribute wrapping.

``wrap(owner, name, make)`` replaces ``owner.name`` by ``make(current)``. Each wrap is keyed by
the ``make`` function (its module and qualified name), so applying the same patch twice is a
no-op while two different patches of the same attribute (e.g. the protocol and the producer
patches of ``DSparkSpeculator.init_cudagraph_manager``) both take effect, the later one wrapping
the earlier. :func:`original` follows the chain back to vLLM's own attribute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MARK = "__vllm_dspark_pp_original__"  # the attribute this wrapper wraps
_KEYS = "__vllm_dspark_pp_wraps__"  # keys of every wrap in the chain, innermost first


def _raw(owner: Any, name: str) -> Any:
    # the class-dict entry (staticmethod/classmethod objects stay as they are), else getattr
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in vars(klass):
                return vars(klass)[name]
    return getattr(owner, name, None)


def is_patched(owner: Any, name: str, key: str | None = None) -> bool:
    """Whether ``owner.name`` is wrapped by us (by the wrap ``key``, when given)."""
    keys = getattr(_raw(owner, name), _KEYS, ())
    return bool(keys) if key is None else key in keys


def original(owner: Any, name: str) -> Any:
    """The attribute as vLLM defined it, before any patch of ours."""
    attr = getattr(owner, name)
    while hasattr(attr, _MARK):
        attr = getattr(attr, _MARK)
    return attr


def wrap_key(make: Callable[[Any], Any]) -> str:
    return f"{make.__module__}.{make.__qualname__}"


def wrap(owner: Any, name: str, make: Callable[[Any], Any], key: str | None = None) -> bool:
    """Replace ``owner.name`` by ``make(current)``; returns False when this wrap is already
    there."""
    key = key or wrap_key(make)
    current = getattr(owner, name)
    keys = tuple(getattr(current, _KEYS, ()))
    if key in keys:
        return False
    new = make(current)
    setattr(new, _MARK, current)
    setattr(new, _KEYS, keys + (key,))
    setattr(owner, name, new)
    return True
