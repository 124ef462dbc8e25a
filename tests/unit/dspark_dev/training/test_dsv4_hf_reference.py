"""The whole pure-torch DeepSeek-V4 target (dspark_dev/training/dsv4_models.py) against an
independent implementation that runs on the CPU: transformers' ``DeepseekV4ForCausalLM``, loaded
with ``from_pretrained`` from the very checkpoint ``vllm_checkpoint`` writes (transformers renames
the original DeepSeek-V4 names itself, conversion_mapping.py). Float32, a small config with both
compressor kinds (ratio 4 with the overlap and the indexer, ratio 8 standing in for 128), a 16-token
sliding window and 40 tokens, so the window, the compressed entries' causality, the attention
sink, the inverse RoPE and both routings are all exercised.

This is not vLLM (whose attention only runs on the GPU, docs/dsv4-pure-torch.md): it is a second
reading of the same architecture, so agreement makes a misreading of ours unlikely where the two
could have differed. The GPU script dspark_dev/training/dsv4_check.py compares with vLLM itself.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dspark_dev import tiny_mla_drafts
from dspark_dev.training import dsv4_models as M

T = 40

pytestmark = pytest.mark.skipif(
    os.environ.get("DSPARK_DSV4_CPU_CHECKS") != "1",
    reason="opt-in (about 10 s, mostly importing transformers' model): DSPARK_DSV4_CPU_CHECKS=1",
)


def _config(**query_side) -> dict:
    cfg = tiny_mla_drafts.tiny_dsv4_config(gpu=False).to_dict()
    cfg.update(query_side)
    cfg.update(
        {
            "architectures": ["DeepseekV4ForCausalLM"],
            "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
            "compress_rates": {
                "compressed_sparse_attention": 4,
                "heavily_compressed_attention": 8,
            },
            "index_topk": 64,  # >= the 10 compressed entries: the short-context rule
            "torch_dtype": "float32",
        }
    )
    return cfg


# "one-group": the query side of the training geometry (tiny_mla_targets.DSV4_TRAIN_ATTENTION:
# 8 heads in a single wo_a group), at the CPU config's widths.
@pytest.mark.parametrize(
    "query_side",
    [{}, {"num_attention_heads": 8, "o_groups": 1, "o_lora_rank": 16}],
    ids=["cpu", "one-group"],
)
def test_target_matches_transformers_deepseek_v4(query_side, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cfg_d = _config(**query_side)
    cfg = M.DSV4Config.from_dict(cfg_d)
    assert cfg.qk_rope_head_dim == 8 and cfg.compress_ratio(1) == 8
    target, draft = M.TinyDSV4(cfg), M.TinyDSV4Draft(cfg)
    M.init_pair(target, draft, seed=3)
    (tmp_path / "config.json").write_text(json.dumps(cfg_d))
    save_file(M.vllm_checkpoint(target, None), str(tmp_path / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(4, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, _ = target(ids)
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
