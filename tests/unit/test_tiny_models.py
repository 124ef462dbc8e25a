"""The tiny Qwen3 target + DSpark draft: deterministic files, vLLM configs, exact parameter
names."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_dspark_pp.tiny_models import DRAFT_DIR_NAME, make_tiny_models


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_same_seed_gives_byte_identical_files(tmp_path):
    a = make_tiny_models(tmp_path / "a", seed=3)
    b = make_tiny_models(tmp_path / "b", seed=3)
    c = make_tiny_models(tmp_path / "c", seed=4)
    da, db, dc = (_digests(Path(x.root)) for x in (a, b, c))
    assert da == db
    assert len(da) >= 10
    assert da["tiny-qwen3-target/model.safetensors"] != dc["tiny-qwen3-target/model.safetensors"]
    assert da[f"{DRAFT_DIR_NAME}/model.safetensors"] != dc[f"{DRAFT_DIR_NAME}/model.safetensors"]
    # Only the weights depend on the seed (configs / tokenizer do not, except the README's note).
    assert da["tiny-qwen3-target/config.json"] == dc["tiny-qwen3-target/config.json"]


def test_draft_dir_is_detected_as_dspark_and_configs_are_consistent(tiny_models):
    assert "dspark" in os.path.basename(tiny_models.draft).lower()
    t = json.loads(Path(tiny_models.target, "config.json").read_text())
    d = json.loads(Path(tiny_models.draft, "config.json").read_text())
    assert t["architectures"] == ["Qwen3ForCausalLM"]
    assert d["architectures"] == ["DSparkDraftModel"] and d["model_type"] == "qwen3"
    assert d["vocab_size"] == t["vocab_size"] and d["target_hidden_size"] == t["hidden_size"]
    assert all(0 <= i < t["num_hidden_layers"] for i in d["target_layer_ids"])
    assert t["dtype"] == "float32"


def test_tokenizer_round_trips_and_has_the_mask_token(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models.target)
    d = json.loads(Path(tiny_models.draft, "config.json").read_text())
    assert tok.convert_tokens_to_ids("<|mask|>") == d["mask_token_id"]
    ids = tok("the quick brown fox jumps over the lazy dog")["input_ids"]
    assert tok.unk_token_id not in ids and len(ids) == 9
    assert tok.decode(ids) == "the quick brown fox jumps over the lazy dog"
    assert len(tok) == d["vocab_size"]


def test_bfloat16_option(tmp_path):
    from safetensors import safe_open

    p = make_tiny_models(tmp_path, dtype="bfloat16")
    with safe_open(os.path.join(p.target, "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype.__str__() == "torch.bfloat16"
    assert json.loads(Path(p.target, "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        make_tiny_models(tmp_path / "x", dtype="int8")


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_vllm_builds_the_dspark_engine_config(tiny_models, pp):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    cfg = EngineArgs(
        model=tiny_models.target,
        speculative_config={"model": tiny_models.draft},
        pipeline_parallel_size=pp,
        dtype="float32",
        enforce_eager=True,
    ).create_engine_config()
    spec = cfg.speculative_config
    d = json.loads(Path(tiny_models.draft, "config.json").read_text())
    assert spec.method == "dspark"
    assert spec.num_speculative_tokens == d["block_size"]
    assert spec.draft_model_config.architectures == ["Qwen3DSparkModel"]
    assert cfg.parallel_config.pipeline_parallel_size == pp
    assert cfg.model_config.hf_config.num_hidden_layers % pp == 0
    # Qwen3 DSpark reads target layer i's output as aux id i + 1 (eagle3_utils "+1" rule).
    assert get_eagle3_aux_layers_from_config(spec) == tuple(i + 1 for i in d["target_layer_ids"])


_LOAD_CHECK = textwrap.dedent(
    """
    import json, sys, torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from vllm.utils.network_utils import get_open_port

    target, draft = sys.argv[1], sys.argv[2]
    cfg = EngineArgs(model=target, speculative_config={"model": draft}, dtype="float32",
                     enforce_eager=True).create_engine_config()
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
        initialize_model_parallel(1, 1)
        models = {"target": Qwen3ForCausalLM(vllm_config=cfg),
                  "draft": Qwen3DSparkForCausalLM(vllm_config=cfg)}
    report = {}
    for name, model in models.items():
        for p in model.parameters():
            p.data.fill_(float("nan"))
        weights = load_file((target if name == "target" else draft) + "/model.safetensors")
        loaded = model.load_weights(iter(weights.items()))
        report[name] = {
            "params": sorted(n for n, _ in model.named_parameters()),
            "unloaded": sorted(n for n, p in model.named_parameters()
                               if torch.isnan(p.data.float()).any()),
            "returned": None if loaded is None else sorted(loaded),
            "has_own_embed_tokens": getattr(model, "has_own_embed_tokens", None),
            "has_own_lm_head": getattr(model, "has_own_lm_head", None),
        }
    print("REPORT" + json.dumps(report))
    """
)


def test_every_vllm_parameter_is_loaded_from_the_checkpoints(tiny_models):
    """Build vLLM's Qwen3 and Qwen3 DSpark modules, fill every parameter with NaN, load the
    safetensors with vLLM's own load_weights, and require that no parameter stays NaN (i.e. no
    name was skipped or mis-mapped). Runs in a subprocess: it initialises torch.distributed."""
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_CHECK, tiny_models.target, tiny_models.draft],
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(line[len("REPORT") :])
    tgt, drf = report["target"], report["draft"]
    assert tgt["unloaded"] == []
    assert tgt["returned"] == tgt["params"]  # Qwen3's loader reports each parameter it filled
    # embed, lm_head, final norm; per layer: 2 norms, qkv (stacked), o, q_norm, k_norm, gate_up,
    # down
    assert len(tgt["params"]) == 3 + 6 * 8
    # mask_embedding is vLLM's unused placeholder (DSpark masks via the vocab row
    # mask_token_id, qwen3_dspark.load_weights drops it): the only parameter not in the files.
    assert drf["unloaded"] == ["model.mask_embedding"]
    assert drf["has_own_embed_tokens"] is True and drf["has_own_lm_head"] is True
    for expected in (
        "model.fc.weight",
        "model.markov_head.markov_w1.weight",
        "model.markov_head.markov_w2.weight",
        "model.confidence_head.proj.weight",
        "model.confidence_head.proj.bias",
        "model.embed_tokens.weight",
        "lm_head.weight",
    ):
        assert expected in drf["params"]
