"""The DeepSeek-V4.1 training family (dspark_dev/training/dsv41_train.py), without vLLM: the
exported config is V4.1's (``compress_ratios`` per layer with the MTP stages, no V4 layer typing),
the checkpoint (with its vision stand-in) round-trips into the training modules, and the reference
refuses what it does not model (ratio 2, a compressed layer reading another layer's cache)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark_dev.training import dsv41_models as M
from dspark_dev.training import dsv41_train as D

REPO = Path(__file__).resolve().parents[4]
TOKENIZER = REPO / "models" / "tiny-pair" / "target" / "tokenizer.json"


def test_exported_config_is_v41():
    cfg, view = D.build_dsv41_configs(448, 7, 32, 2)
    hf = D.dsv41_hf_config(cfg)
    assert hf["model_type"] == "deepseek_v41"
    assert hf["architectures"] == ["DeepseekV41ForCausalLM"]
    assert hf["compress_ratios"] == [0, 1, 0, 0]  # 2 layers + 2 MTP stages
    assert hf["kv_source_layer_ids"] == hf["index_source_layer_ids"] == [1]
    assert hf["dspark_target_layer_ids"] == [1, 2] == view.target_layer_ids
    assert hf["dspark_block_size"] == 7 == view.block_size
    assert not {"layer_types", "mlp_layer_types", "compress_rates"} & set(hf)
    assert cfg.num_hash_layers == 0
    # the vision stand-in: no ViT block (vLLM's text-path switches read vision_n_layers)
    assert hf["vision_config"] == D.VISION_CONFIG and hf["vision_config"]["num_hidden_layers"] == 0


def test_vision_stand_in_is_reproducible_and_leaves_the_rng_alone():
    """``vision_tensors`` gives the same tensors at every export, with the shapes vLLM's
    vision-language class registers for the exported ``vision_config`` (patch 14, downsample 3:
    vLLM's defaults), and draws nothing from the global RNG the training seeds."""
    torch.manual_seed(7)
    a = D.vision_tensors(256)
    after = torch.rand(3)
    torch.manual_seed(7)
    b = D.vision_tensors(256)
    torch.testing.assert_close(torch.rand(3), after)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {k: tuple(v.shape) for k, v in a.items()} == {
        "image_start": (256,),
        "image_end": (256,),
        "image_newline": (256,),
        "vision.patch_embed.proj.weight": (16, 3 * 14 * 14),
        "vision.patch_embed.proj.bias": (16,),
        "vision.norm.weight": (16,),
        "aligner.w1.weight": (256, 16 * 3 * 3),
        "aligner.w1.bias": (256,),
        "aligner.w2.weight": (256, 256),
        "aligner.w2.bias": (256,),
    }
    assert {v.dtype for v in a.values()} == {torch.bfloat16}


def test_written_pair_round_trips(tmp_path):
    torch.manual_seed(0)
    cfg, view = D.build_dsv41_configs(448, 4, 8, 2)
    target, draft = D.DSV41TrainTarget(cfg, seed=0), D.DSV41TrainDraft(cfg, view, seed=1)
    draft.init_from_target(target)
    with torch.no_grad():
        draft.mask_embedding.normal_()
    from dspark_dev.training.export import round_to_bf16_

    round_to_bf16_(target, draft)
    extra = {"target_config": cfg.to_dict(), "draft_config": view.to_dict()}
    D.write_dsv41_pair(str(tmp_path), target, draft, str(TOKENIZER), extra)
    assert (tmp_path / "README.md").read_text().startswith("# Tiny DeepSeek-V4.1 pair")
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / D.DSV41_DIR / "model.safetensors"
    sd = load_file(str(ckpt))
    assert all(torch.equal(sd[k], v) for k, v in D.vision_tensors(cfg.hidden_size).items())
    t2, d2 = D.load_dsv41_pair(str(tmp_path))
    ids = torch.randint(3, 400, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        (l1, _, a1), (l2, _, a2) = target(ids, (1, 2)), t2(ids, (1, 2))
        torch.testing.assert_close(l1, l2)
        anchors = torch.tensor([[5, 11]])
        o1 = draft(ids, draft.context(a1), anchors, target.head.weight)
        o2 = d2(ids, d2.context(a2), anchors, t2.head.weight)
    for x, y in zip(o1, o2, strict=True):
        torch.testing.assert_close(x, y)
    # control: a checkpoint without the stand-in (or with other values) does not load
    del sd["image_start"]
    save_file(sd, str(ckpt), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="image_start is not in the checkpoint"):
        D.load_dsv41_pair(str(tmp_path))


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"compress_ratios": [0, 2, 0, 0]}, "compress ratio 2"),
        ({"compress_ratios": [0, 1, 1, 0], "num_hidden_layers": 3}, "kv sharing"),
    ],
)
def test_unmodelled_topology_is_refused(edit, match):
    cfg = M.DSV41Config(**edit)
    with pytest.raises(NotImplementedError, match=match):
        M.TinyDSV41(cfg)
