"""Test probe for the Kimi-K3 PP=2 diagnosis in tests/gpu/test_dsv4_k3_pp.py, loaded by every
process of a deployment that has this directory first on PYTHONPATH (Python imports
``sitecustomize`` at start-up); then the next ``sitecustomize`` on the path runs too.

With ``DSPARK_TEST_K3_IDS_PROBE=1``, each call of the Kimi-K3 target's ``embed_input_ids`` (the
first op of PP rank 0's forward; eager engines only, a compiled graph does not call it) prints
``K3_IDS_PROBE pid=.. call=.. n=.. min=.. max=.. vocab=..`` to stderr for its first 40 calls, and
every call whose ids fall outside the vocabulary prints them and their positions (it syncs the
device: a diagnosis aid, never for timing).

The sync-point, side-stream and UVA-depth probes of ``k3_sync_probe.py`` (this directory; each off
unless its ``DSPARK_TEST_K3_*`` variable is set) are installed here too.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys


def _load_sync_probe():
    """``k3_sync_probe.py`` of this directory, loaded by its path (nothing added to the path)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "k3_sync_probe.py")
    spec = importlib.util.spec_from_file_location("k3_sync_probe", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["k3_sync_probe"] = module
    spec.loader.exec_module(module)
    return module


def _install() -> None:
    _load_sync_probe().install()
    if os.environ.get("DSPARK_TEST_K3_IDS_PROBE") != "1":
        return
    from vllm_dspark_pp.patches import when_imported

    def patch_model(module) -> None:
        cls = module.KimiLinearModel
        real = cls.embed_input_ids
        calls = {"n": 0}

        def embed_input_ids(self, input_ids):
            calls["n"] += 1
            vocab = int(self.embed_tokens.weight.shape[0]) if hasattr(self, "embed_tokens") else -1
            ids = input_ids.detach().to("cpu")
            lo = int(ids.min()) if ids.numel() else 0
            hi = int(ids.max()) if ids.numel() else 0
            bad = (ids < 0) | (ids >= vocab) if vocab > 0 else ids < 0
            if calls["n"] <= 40 or bool(bad.any()):
                print(
                    f"K3_IDS_PROBE pid={os.getpid()} call={calls['n']} n={ids.numel()} min={lo} "
                    f"max={hi} vocab={vocab}",
                    file=sys.stderr,
                    flush=True,
                )
            if bool(bad.any()):
                where = bad.nonzero().flatten().tolist()
                print(
                    f"K3_IDS_PROBE pid={os.getpid()} OUT OF RANGE at positions {where[:64]}: "
                    f"{ids[bad].tolist()[:64]}; all ids {ids.tolist()[:256]}",
                    file=sys.stderr,
                    flush=True,
                )
            return real(self, input_ids)

        cls.embed_input_ids = embed_input_ids

    when_imported("vllm.models.kimi_k3.nvidia.model", patch_model)


_CHAIN = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sitecustomize_chain.py"
)
runpy.run_path(_CHAIN)["install_then_chain"](__file__, _install)
