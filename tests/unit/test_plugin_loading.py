"""The plugin is found and applied by vLLM's own loader, once per process, and gated on vLLM's
version."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest

from vllm_dspark_pp.patches import registry
from vllm_dspark_pp.version import (
    SUPPORTED_VLLM_VERSIONS,
    UnsupportedVLLMVersionError,
    check_vllm_version,
)


def _run_python(code: str, timeout: int = 240, **env) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


#: The patch targets a process has once the plugin is applied: vLLM's config (``config_vllm``
#: patches ``VllmConfig`` at once: every vLLM process builds one) and what that module imports
#: itself. Every other patch waits for its target's import (``patches.when_imported``), so the
#: API server does not import GPU-worker modules for nothing.
IMPORTED_BY_APPLYING = {"vllm.config.vllm", "vllm.v1.kv_cache_interface"}


def test_vllm_loader_applies_every_registered_patch_in_a_fresh_process():
    proc = _run_python(
        """
        import sys
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm_dspark_pp.patches import applied_patches, registry
        names = [p.name for p in registry()]
        assert applied_patches() == names, (applied_patches(), names)
        print("APPLIED", len(names))
        print("TARGETS IMPORTED", sorted({p.target for p in registry() if p.target in sys.modules}))
        """
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    n = len(registry())
    assert f"APPLIED {n}" in out
    assert f"TARGETS IMPORTED {sorted(IMPORTED_BY_APPLYING)}" in out, out[-3000:]
    # the single start-up log line through vLLM's logger
    assert f"vllm-dspark-pp 0.1.0 applied {n} patches" in out, out[-3000:]


def test_plugin_is_not_applied_when_excluded_by_vllm_plugins():
    proc = _run_python(
        """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm_dspark_pp.patches import applied_patches
        print("APPLIED", len(applied_patches()))
        """,
        VLLM_PLUGINS="some_other_plugin",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "APPLIED 0" in proc.stdout


def _snapshot(module_name: str) -> dict[str, int]:
    """Identity of every attribute of a module and of the classes it defines."""
    mod = importlib.import_module(module_name)
    snap = {}
    for key, value in list(vars(mod).items()):
        snap[key] = id(value)
        if isinstance(value, type):
            for attr, member in list(vars(value).items()):
                snap[f"{key}.{attr}"] = id(member)
    return snap


def test_applying_twice_is_harmless():
    from vllm_dspark_pp import register

    register()
    for info in registry():
        before = _snapshot(info.target)
        info.module.apply()  # a second application of each patch
        assert _snapshot(info.target) == before, f"{info.name}.apply() is not idempotent"
    register()  # and the whole entry point again


@pytest.mark.parametrize("version", ["0.33.0", "0.34.1", "0.35.0rc1"])
def test_version_gate_refuses_other_versions(version):
    with pytest.raises(UnsupportedVLLMVersionError) as info:
        check_vllm_version(version)
    msg = str(info.value)
    assert version in msg and SUPPORTED_VLLM_VERSIONS[-1] in msg
    assert "pip install vllm==" in msg


def test_version_gate_accepts_the_pinned_release():
    assert check_vllm_version() == "0.34.0"


def test_wrong_vllm_version_fails_start_up_before_any_patch():
    proc = _run_python(
        """
        import vllm
        vllm.__version__ = "0.33.0"
        from vllm.plugins import load_general_plugins
        try:
            load_general_plugins()
        except Exception as exc:
            from vllm_dspark_pp.patches import applied_patches
            print("RAISED", type(exc).__name__, "| patches:", len(applied_patches()))
            print(exc)
            raise SystemExit(3)
        print("NOT RAISED")
        """
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr[-2000:]
    assert "RAISED UnsupportedVLLMVersionError | patches: 0" in proc.stdout
    assert "supports vLLM 0.34.0 only" in proc.stdout
