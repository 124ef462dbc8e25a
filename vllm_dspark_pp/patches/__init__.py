"""The patch registry.

Every module in this package (except those starting with ``_``) is one patch of one vLLM module,
named after it (``v1_engine_core`` patches ``vllm.v1.engine.core``). Each module has a header
docstring with the fields WHAT / WHY / UPSTREAM / RETIRE WHEN / TESTED BY, and defines:

* ``TARGET``: the dotted name of the vLLM module it changes;
* ``apply()``: installs the patch; must be safe to call on an already patched process.

:func:`apply_all` applies each patch once per process and logs one line naming the plugin
version and the patches applied. ``docs/patches.md`` is generated from :func:`registry`
(``vllm-dspark-pp patches --markdown``) and a unit test checks that it matches.

Public helper: :func:`when_imported` (run a callback on a module right after its import, or at
once if it is imported already): what every patch here uses to wait for its target, and what
benchmarks and test probes outside the package use to hook vLLM modules the same way.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import threading
from dataclasses import dataclass
from types import ModuleType

from vllm_dspark_pp import envs
from vllm_dspark_pp.patches._on_import import when_imported

__all__ = ["PatchInfo", "apply_all", "applied_patches", "registry", "when_imported"]

FIELDS = ("WHAT", "WHY", "UPSTREAM", "RETIRE WHEN", "TESTED BY")

#: Diagnosis only (e.g. which patch costs what in a benchmark): comma-separated patch names this
#: process does not apply. ``config_vllm`` cannot be skipped: it refuses PP>1 while any patch is
#: skipped (the PP protocol patches keep pipelines from hanging).
SKIP_ENV = "VLLM_DSPARK_PP_SKIP_PATCHES"
_UNSKIPPABLE = "config_vllm"
#: Patches that PP>1 may run without (the controls of the lost-stage test and of the PP stream
#: ordering test): without the first two a lost PP stage is seen late, without the stream patch
#: PP ranks may exchange stale token ids as stock vLLM does (a failed request, never a hang).
PP_SKIPPABLE = frozenset(
    {
        "distributed_device_communicators_shm_broadcast",
        "v1_executor_multiproc_executor",
        "v1_worker_gpu_model_runner__streams",
    }
)

_lock = threading.Lock()
_applied: list[str] = []
_done = False


@dataclass(frozen=True)
class PatchInfo:
    name: str
    target: str
    fields: dict[str, str]
    module: ModuleType


def _parse_header(doc: str) -> dict[str, str]:
    """Split a docstring into its ``FIELD:`` paragraphs (see FIELDS)."""
    alternatives = "|".join(re.escape(f) for f in FIELDS)
    pattern = re.compile(rf"^({alternatives}):\s*", re.M)
    parts = pattern.split(doc or "")
    found: dict[str, str] = {}
    for key, body in zip(parts[1::2], parts[2::2], strict=True):
        found[key] = " ".join(body.split())
    return found


def registry() -> list[PatchInfo]:
    """All patch modules, sorted by name, with their parsed headers."""
    infos = []
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        infos.append(
            PatchInfo(
                mod.name, getattr(module, "TARGET", ""), _parse_header(module.__doc__ or ""), module
            )
        )
    return infos


def applied_patches() -> list[str]:
    return list(_applied)


def skipped_patches(names: list[str] | None = None, value: str | None = None) -> list[str]:
    """The patch names :data:`SKIP_ENV` (or ``value``) asks to skip; unknown names and
    ``config_vllm`` raise ``ValueError`` (at start-up: ``register`` runs this)."""
    value = envs.VLLM_DSPARK_PP_SKIP_PATCHES if value is None else value
    skip = [s.strip() for s in value.split(",") if s.strip()]
    if not skip:
        return []
    known = names if names is not None else [info.name for info in registry()]
    unknown = sorted(set(skip) - set(known))
    if unknown:
        raise ValueError(f"{SKIP_ENV} names unknown patches {unknown}; known: {', '.join(known)}")
    if _UNSKIPPABLE in skip:
        raise ValueError(
            f"{SKIP_ENV} cannot skip {_UNSKIPPABLE}: it refuses PP>1 while patches are skipped"
        )
    return skip


def apply_all() -> list[str]:
    """Apply every registered patch once in this process; later calls do nothing."""
    global _done
    with _lock:
        if _done:
            return list(_applied)
        from vllm.logger import init_logger

        from vllm_dspark_pp.version import __version__

        infos = registry()
        skip = skipped_patches([info.name for info in infos])
        for info in infos:
            if info.name in skip:
                continue
            info.module.apply()
            _applied.append(info.name)
        _done = True
        _ensure_vllm_logging()
        if skip:
            init_logger("vllm.dspark_pp").warning(
                "vllm-dspark-pp: %s=%s: NOT applying %s (diagnosis only; PP>1 is refused unless "
                "only %s are skipped)",
                SKIP_ENV,
                envs.VLLM_DSPARK_PP_SKIP_PATCHES,
                ", ".join(skip),
                ", ".join(sorted(PP_SKIPPABLE)),
            )
        init_logger("vllm.dspark_pp").info(
            "vllm-dspark-pp %s applied %d patches: %s",
            __version__,
            len(_applied),
            ", ".join(_applied) or "(none)",
        )
        return list(_applied)


def _ensure_vllm_logging() -> None:
    """vLLM 0.34.0 configures its loggers lazily (vllm serve, the engine and the workers do it
    before plugins load). In a bare process (``load_general_plugins()`` from a script) nothing
    would print our start-up line, so apply vLLM's default logging config, as vLLM itself would."""
    import logging

    if logging.getLogger("vllm").handlers:
        return
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    configure_logging(LoggingConfig())


def markdown_index() -> str:
    """The human index written to docs/patches.md."""
    lines = [
        "# Patches applied to vLLM",
        "",
        "Generated from the patch registry (`vllm-dspark-pp patches --markdown > "
        "docs/patches.md`);",
        "`tests/unit/patches/test_patch_registry.py` fails when this file and the registry "
        "disagree.",
        "Every patch is version-gated: the plugin refuses to run on any vLLM but the supported",
        "release (see `vllm_dspark_pp/version.py`).",
        "",
    ]
    for info in registry():
        lines += [f"## `{info.name}` (patches `{info.target}`)", ""]
        for field in FIELDS:
            lines.append(f"- **{field.capitalize()}**: {info.fields.get(field, '(missing)')}")
        lines.append("")
    return "\n".join(lines)
