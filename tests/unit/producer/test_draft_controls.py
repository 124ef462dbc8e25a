"""The subtle PD control's writer (``support.draft_controls.aux_perturbed_draft``, issue 26 item
2): the copy differs from the original draft only in the context projection's aux column blocks,
exactly as asked (the default: first and last exchanged; a scale: one block times the factor),
for a Kimi-K3 draft directory, a DeepSeek-V4 checkpoint (target tensors + ``mtp.*`` draft in one
file) and a Qwen3 DSpark draft (``fc``), and for the bundled tiny pair's real draft. Toy
checkpoints, no engine: < 1 s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from support.draft_controls import SUBTLE_PERTURB, aux_perturbed_draft, context_proj_layout

HIDDEN = 8

# family -> (context projection name, aux-id key, aux ids, other tensors' names)
LAYOUTS = {
    "k3": (
        "context_proj.weight",
        "target_layer_ids",
        [0, 2, 3],
        [
            "context_norm.weight",
            "layers.0.self_attn.kv_a_proj_with_mqa.weight",
            "final_norm.weight",
        ],
    ),
    "dsv4": (
        "mtp.0.main_proj.weight",
        "dspark_target_layer_ids",
        [0, 1],
        ["embed.weight", "layers.0.attn.wkv.weight", "mtp.0.main_norm.weight", "mtp.1.norm.weight"],
    ),
    "qwen3": (  # the trained tiny pair's draft (issue 40's TP x PP PD subtle control)
        "fc.weight",
        "target_layer_ids",
        [0, 2, 3],
        ["hidden_norm.weight", "layers.0.self_attn.k_proj.weight", "norm.weight"],
    ),
}


def _toy(tmp_path: Path, fam: str) -> Path:
    name, key, ids, others = LAYOUTS[fam]
    d = tmp_path / fam
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    sd = {name: torch.randn(HIDDEN, HIDDEN * len(ids), generator=g).to(torch.bfloat16)}
    for o in others:
        sd[o] = torch.randn(HIDDEN, HIDDEN, generator=g).to(torch.bfloat16)
    sd["hash_table"] = torch.arange(12, dtype=torch.int32)  # a non-float tensor rides along
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({key: ids, "rms_norm_eps": 1e-6}))
    (d / "tokenizer.json").write_text("{}")
    return d


def _load(d: Path) -> tuple[dict, dict]:
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _block(w: torch.Tensor, n: int, j: int) -> torch.Tensor:
    width = w.shape[1] // n
    j = range(n)[j]
    return w[:, j * width : (j + 1) * width]


# perturbation -> {block index (from the end too): where its new columns come from, or a factor}
CASES = {
    SUBTLE_PERTURB: {0: ("block", -1), -1: ("block", 0)},
    "swap:0:1": {0: ("block", 1), 1: ("block", 0)},
    "scale:-1:0.5": {-1: ("times", 0.5)},
    "scale:0:2": {0: ("times", 2.0)},
}


@pytest.mark.parametrize("perturb", sorted(CASES))
@pytest.mark.parametrize("fam", sorted(LAYOUTS))
def test_aux_perturbed_draft_changes_only_the_asked_aux_blocks(tmp_path, fam, perturb):
    name, _, ids, _ = LAYOUTS[fam]
    n = len(ids)
    src = _toy(tmp_path, fam)
    assert context_proj_layout(str(src))[1:] == (name, ids)
    out = Path(aux_perturbed_draft(str(src), str(tmp_path / "out"), perturb))
    assert out != src and out.name == f"{fam}-aux-perturbed-control"
    for f in ("config.json", "tokenizer.json"):
        assert (out / f).read_bytes() == (src / f).read_bytes(), f
    (a, meta_a), (b, meta_b) = _load(src), _load(out)
    assert meta_a == meta_b
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        if k != name:
            assert torch.equal(a[k], b[k]), f"{k} changed"
    want = {range(n)[j]: how for j, how in CASES[perturb].items()}
    for j in range(n):  # exact: a permutation, or bf16 times a power of two
        got = _block(b[name], n, j)
        kind, arg = want.get(j, ("block", j))
        ref = _block(a[name], n, arg) if kind == "block" else _block(a[name], n, j).float() * arg
        assert torch.equal(got.float(), ref.float()), f"aux block {j}"
    assert not torch.equal(b[name], a[name])


def test_aux_perturbed_draft_refuses_a_draft_without_a_context_projection(tmp_path):
    d = _toy(tmp_path, "k3")
    save_file({"other.weight": torch.zeros(2, 2)}, str(d / "model.safetensors"))
    with pytest.raises(AssertionError, match="no context projection"):
        aux_perturbed_draft(str(d), str(tmp_path / "out"))


def test_the_tiny_pair_draft_gets_its_fc_aux_blocks_exchanged(tmp_path):
    """The real bundled draft (models/tiny-pair): ``fc`` ([128, 3 x 128], taps 0, 2, 3) with its
    first and last aux blocks exchanged, every other tensor equal. Control: before ``fc.weight``
    was in ``CONTEXT_PROJ`` this raised "no context projection"."""
    from support import tiny_pair

    ok, why = tiny_pair.available()
    if not ok:
        pytest.skip(why)
    assert context_proj_layout(tiny_pair.DRAFT)[1:] == ("fc.weight", [0, 2, 3])
    out = Path(aux_perturbed_draft(tiny_pair.DRAFT, str(tmp_path)))
    (a, _), (b, _) = _load(Path(tiny_pair.DRAFT)), _load(out)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a if k != "fc.weight")
    assert torch.equal(_block(b["fc.weight"], 3, 0), _block(a["fc.weight"], 3, -1))
    assert torch.equal(_block(b["fc.weight"], 3, -1), _block(a["fc.weight"], 3, 0))
    assert torch.equal(_block(b["fc.weight"], 3, 1), _block(a["fc.weight"], 3, 1))
