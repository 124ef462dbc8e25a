"""The K3 target checkpoint names cover every parameter shard vLLM 0.34.0's default loader
requires (CPU, pure Python, well under a second).

vLLM's ``track_weights_loading`` (model_loader/default_loader.py:568-573, 608-612) adds
``<param>.<shard>`` for each shard of a stacked linear that has rows on the rank and was not
loaded (``StackedColumnParallelLinear.pop_missing_shards``, model_executor/layers/linear.py:
727-741). For a KDA layer the stacked ``in_proj_qkvgfab`` holds q, k, v, g, f_a, b and, when the
TP-local row count is unaligned, a padding shard 6 (models/kimi_k3/nvidia/kda.py:641-659); the
checkpoint names that fill shards are model.py:1342-1356. The committed CPU pair (2 KDA heads x
64) failed on the H200 with ``in_proj_qkvgfab.weight.6`` not initialised; this test reproduces
that from the names alone.
"""

import pytest

from dspark_dev.training.k3_models import (
    K3TargetConfig,
    TinyK3,
    check_kda_geometry,
    kda_in_proj_shard_rows,
)

# checkpoint projection -> in_proj_qkvgfab shard id, with the full-rank gate (model.py:1342-1356)
SHARD_OF = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "g_proj": 3, "f_a_proj": 4, "b_proj": 5}


def required_shard_names(cfg: K3TargetConfig, tp_size: int = 1) -> set[str]:
    """``<layer>.self_attn.in_proj_qkvgfab.weight.<shard>`` for every shard with rows per rank."""
    rows = kda_in_proj_shard_rows(cfg.kda_num_heads, cfg.kda_head_dim, tp_size)
    return {
        f"model.layers.{i}.self_attn.in_proj_qkvgfab.weight.{shard}"
        for i in range(cfg.num_hidden_layers)
        if cfg.is_kda(i)
        for shard, n in enumerate(rows)
        if n
    }


def filled_shard_names(checkpoint_names) -> set[str]:
    """Shards that the checkpoint's tensors fill through vLLM's stacked-parameter mapping."""
    out = set()
    for name in checkpoint_names:
        parts = name.split(".")
        if len(parts) == 6 and parts[3] == "self_attn" and parts[4] in SHARD_OF:
            layer = ".".join(parts[:4])
            out.add(f"{layer}.in_proj_qkvgfab.weight.{SHARD_OF[parts[4]]}")
    return out


def missing_shards(cfg: K3TargetConfig, names=None) -> set[str]:
    names = TinyK3(cfg).hf_state_dict().keys() if names is None else names
    return required_shard_names(cfg) - filled_shard_names(names)


def test_rule_matches_the_h200_failure():
    # 4*2*64 + 64 + 2 = 578 rows: 14 rows of padding, the shard the H200 log named
    assert kda_in_proj_shard_rows(2, 64) == [128, 128, 128, 128, 64, 2, 14]
    assert kda_in_proj_shard_rows(16, 16) == [256, 256, 256, 256, 16, 16]


def test_old_committed_geometry_is_not_loadable():
    old = K3TargetConfig(vocab_size=448, kda_num_heads=2, kda_head_dim=64)
    assert missing_shards(old) == {
        "model.layers.0.self_attn.in_proj_qkvgfab.weight.6",
        "model.layers.2.self_attn.in_proj_qkvgfab.weight.6",
    }
    with pytest.raises(ValueError, match=r"in_proj_qkvgfab.*kda.py:641-659"):
        check_kda_geometry(2, 64)


def test_default_geometry_is_loadable():
    cfg = K3TargetConfig(vocab_size=448)
    assert missing_shards(cfg) == set()
    check_kda_geometry(cfg.kda_num_heads, cfg.kda_head_dim)
    # control: a checkpoint without the gate projection leaves shard 3 unfilled
    names = [n for n in TinyK3(cfg).hf_state_dict() if ".g_proj." not in n]
    assert missing_shards(cfg, names) == {
        "model.layers.0.self_attn.in_proj_qkvgfab.weight.3",
        "model.layers.2.self_attn.in_proj_qkvgfab.weight.3",
    }


def test_export_refuses_an_unaligned_geometry():
    from dspark_dev.training.export import k3_target_hf_config

    with pytest.raises(ValueError, match="multiple of 16"):
        k3_target_hf_config(K3TargetConfig(vocab_size=448, kda_num_heads=2, kda_head_dim=64))
    cfg = k3_target_hf_config(K3TargetConfig(vocab_size=448))
    assert cfg["linear_attn_config"]["num_heads"] == 16


def test_bundled_pair_fills_every_required_shard():
    """models/k3-pair (trained): its config's geometry and its checkpoint's tensor names leave no
    shard of the fused KDA projection unfilled (what stopped the first trained pair on the
    H200). The names come from the safetensors header; nothing is loaded."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    from dspark_dev.training.export import K3_TARGET_DIR

    tdir = Path(__file__).resolve().parents[4] / "models" / "k3-pair" / K3_TARGET_DIR
    with open(tdir / "training.json") as f:
        cfg = K3TargetConfig(**json.load(f)["target_config"])
    with safe_open(str(tdir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert required_shard_names(cfg), "the bundled target has no KDA layer"
    assert missing_shards(cfg, names) == set()
    # control: the same names read as the old 2 x 64 geometry leave the padding shard unfilled
    old = K3TargetConfig(**{**vars(cfg), "kda_num_heads": 2, "kda_head_dim": 64})
    assert missing_shards(old, names) == {
        f"model.layers.{i}.self_attn.in_proj_qkvgfab.weight.6" for i in (0, 2)
    }
