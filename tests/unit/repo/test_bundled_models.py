"""The bundled model pairs stay inside the repository's budget (issue 26: its three pairs'
checkpoints under 20 MB in total; issue 42: the DeepSeek-V4.1 pair, added later, under 10 MB like
each of the others) and each directory holds what its loader reads (pure Python, reads file
sizes and safetensors headers only)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

MODELS = Path(__file__).resolve().parents[3] / "models"
BUDGET_BYTES = 20_000_000  # issue 26's pairs: tiny-pair, k3-pair, dsv4-pair
ISSUE26_PAIRS = ("tiny-pair", "k3-pair", "dsv4-pair")
PAIR_BUDGET_BYTES = 10_000_000  # every pair on its own (issue 42)
# each bundled model directory holds config.json and model.safetensors; the ones served as the
# model (targets) hold tokenizer.json too
SERVED = ("tiny-pair/target", "k3-pair/k3-target", "dsv4-pair/dsv4", "dsv41-pair/dsv41")
MODEL_DIRS = (
    "tiny-pair/target",
    "tiny-pair/dspark-draft",
    "k3-pair/k3-target",
    "k3-pair/k3-dspark",
    "dsv4-pair/dsv4",
    "dsv41-pair/dsv41",
)


def _checkpoints() -> list[Path]:
    return sorted(MODELS.rglob("*.safetensors"))


def test_bundled_checkpoints_fit_the_budget():
    sizes = {str(p.relative_to(MODELS)): p.stat().st_size for p in _checkpoints()}
    total = sum(v for k, v in sizes.items() if k.split("/")[0] in ISSUE26_PAIRS)
    assert total < BUDGET_BYTES, f"issue 26's checkpoints {total} B >= {BUDGET_BYTES} B: {sizes}"
    for pair in {k.split("/")[0] for k in sizes}:
        size = sum(v for k, v in sizes.items() if k.startswith(pair + "/"))
        assert size < PAIR_BUDGET_BYTES, f"{pair}: {size} B >= {PAIR_BUDGET_BYTES} B"
    # every checkpoint on disk belongs to a listed model directory (nothing stray is counted)
    assert sorted(str(Path(s).parent) for s in sizes) == sorted(MODEL_DIRS)


def test_each_bundled_model_directory_is_loadable_by_name():
    for rel in MODEL_DIRS:
        d = MODELS / rel
        cfg = json.loads((d / "config.json").read_text())
        assert cfg.get("architectures"), f"{rel}: config.json names no architecture"
        if rel in SERVED:
            assert (d / "tokenizer.json").is_file(), f"{rel}: no tokenizer.json"
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            names = list(f.keys())
            dtypes = {f.get_slice(n).get_dtype() for n in names}
        assert names, f"{rel}: empty checkpoint"
        assert dtypes <= {"BF16", "F32", "I32", "I64"}, f"{rel}: {dtypes}"  # I32: DSV4 tid2eid
