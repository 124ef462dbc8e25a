"""Corrupted copies of a DSpark draft for PD controls: a control run gives the prefill-only
producer a broken draft and checks that the decoder's acceptance falls, which shows that the
decoder reads the draft context KV the producer wrote (so a PD acceptance check can fail).
Used by tests/e2e/producer (CPU), tests/unit/producer and tests/gpu/test_dsv4_k3_engine.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

#: The corrupted draft's ``rms_norm_eps``: rsqrt(mean(x^2) + eps) is NaN for any real input.
NAN_NORM_EPS = -1e30


def nan_norm_draft(draft_dir: str, out_dir: str) -> str:
    """A copy of ``draft_dir`` whose config differs only in ``rms_norm_eps = -1e30``: the same
    layer names, shapes and (dummy, seeded) weights, but every RMS norm, the context norm
    included, takes the square root of a negative number and outputs NaN, so a prefill-only
    producer loading it writes a NaN draft context KV.

    Not ``eps = NaN``: vLLM 0.34.0 asserts that the draft layers' norm eps are equal
    (``qwen3_dflash.py:663``, and for Kimi-K3 ``dspark_mla.py:244``, which compares every layer
    with the first, itself included), and NaN != NaN stops the engine at start-up (seen on CPU,
    tests/e2e/producer/test_pd_producer_cpu.py). -1e30 equals itself and is plain JSON.

    The PD control's prefiller draft (``run_pd(prefill_speculative_config=...)``); for a draft
    that lives in its target's checkpoint (DeepSeek-V4) the whole directory is copied and only
    the draft reads it."""
    src = Path(draft_dir)
    dst = Path(out_dir) / f"{src.name}-nan-norm-control"
    shutil.copytree(src, dst, dirs_exist_ok=True)
    cfg = json.loads((dst / "config.json").read_text())
    if "rms_norm_eps" not in cfg:
        raise AssertionError(f"{draft_dir}/config.json has no rms_norm_eps to corrupt")
    cfg["rms_norm_eps"] = NAN_NORM_EPS
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(dst)
