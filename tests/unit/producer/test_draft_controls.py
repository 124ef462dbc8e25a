"""The subtle PD control's writer (``support.draft_controls.scaled_aux_draft``, issue 26 item 2):
the copy differs from the original draft only in the context projection's columns of one aux
layer, by exactly the factor asked for, for a Kimi-K3 draft directory and for a DeepSeek-V4
checkpoint (target tensors + ``mtp.*`` draft in one file). Toy checkpoints, no engine: < 1 s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from support.draft_controls import SUBTLE_SCALE, context_proj_layout, scaled_aux_draft

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


@pytest.mark.parametrize("aux_index", [-1, 0])
@pytest.mark.parametrize("fam", sorted(LAYOUTS))
def test_scaled_aux_draft_changes_one_aux_block_by_the_factor(tmp_path, fam, aux_index):
    name, _, ids, _ = LAYOUTS[fam]
    src = _toy(tmp_path, fam)
    assert context_proj_layout(str(src))[1:] == (name, ids)
    out = Path(scaled_aux_draft(str(src), str(tmp_path / "out"), aux_index=aux_index))
    assert out != src and out.name == f"{fam}-scaled-aux-control"
    for f in ("config.json", "tokenizer.json"):
        assert (out / f).read_bytes() == (src / f).read_bytes(), f
    (a, meta_a), (b, meta_b) = _load(src), _load(out)
    assert meta_a == meta_b
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        if k != name:
            assert torch.equal(a[k], b[k]), f"{k} changed"
    j = range(len(ids))[aux_index]
    cols = torch.zeros(a[name].shape[1], dtype=torch.bool)
    cols[j * HIDDEN : (j + 1) * HIDDEN] = True
    assert torch.equal(b[name][:, ~cols], a[name][:, ~cols]), "columns of other aux layers changed"
    # exact: bf16 times a power of two
    assert torch.equal(b[name][:, cols].float(), a[name][:, cols].float() * SUBTLE_SCALE)
    assert not torch.equal(b[name], a[name])


def test_scaled_aux_draft_refuses_a_draft_without_a_context_projection(tmp_path):
    d = _toy(tmp_path, "k3")
    save_file({"other.weight": torch.zeros(2, 2)}, str(d / "model.safetensors"))
    with pytest.raises(AssertionError, match="no context projection"):
        scaled_aux_draft(str(d), str(tmp_path / "out"))
