"""Helpers shared by patch modules: idempotent attribute replacement with the original kept."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MARK = "__vllm_dspark_pp_original__"


def is_patched(owner: Any, name: str) -> bool:
    return hasattr(getattr(owner, name, None), _MARK)


def original(owner: Any, name: str) -> Any:
    """The attribute as vLLM defined it, before any patch of ours."""
    attr = getattr(owner, name)
    return getattr(attr, _MARK, attr)


def wrap(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    """Replace ``owner.name`` by ``make(original)``; a second call is a no-op."""
    if is_patched(owner, name):
        return
    orig = getattr(owner, name)
    new = make(orig)
    setattr(new, _MARK, orig)
    setattr(owner, name, new)
