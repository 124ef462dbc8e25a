"""The bundled DeepSeek-V4.1 pair (models/dsv41-pair/dsv41) passes vLLM 0.34.0's own weight
loading and start-up check, ``DefaultModelLoader.load_weights`` with ``track_weights_loading``,
for every model an engine serving it builds, on CPU (tests/support/tiny_dsv41.py builds vLLM's
CUDA classes here):

* the target ``DeepseekV41ForCausalLM`` (the vision-language class, ``nvidia/vl_model.py``) at
  PP=1, as PP=2 stage 0 and stage 1, and with ``language_model_only``;
* its DSpark drafter ``DSparkV41DraftModel`` and the producer's context-KV-only build of it.

Each also compares names: every parameter and persistent buffer the built model registers must be
filled from a checkpoint tensor (what ``load_weights`` reports loaded), with no exemption:
vLLM's check exempts the parameters of modules whose quant method post-processes weights
(``default_loader.py``, ``track_weights_loading``: every unquantized linear, embedding and head),
which would hide a checkpoint that leaves the vision projections unset. The drafter's embedding
and head are the target's (vLLM's speculator shares them), the only names left out.

Control (``test_the_checkpoint_before_the_vision_stand_in_fails``): the bundle as it was before
the vision stand-in (no ``vision_config``, no ``vision.*`` / ``aligner.*`` / ``image_*`` tensors)
fails the check with the message an H100 start-up printed for it::

    ValueError: Following weights were not initialized from checkpoint:
    {'image_end', 'image_start', 'vision.norm.weight', 'image_newline'}

(PP=1 and stage 0; stage 1 and ``language_model_only``: the three ``image_*``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support import tiny_dsv41 as v41
from support import tp_load

REPO = Path(__file__).resolve().parents[3]
BUNDLED = REPO / "models" / "dsv41-pair" / "dsv41"
VISION_PREFIXES = ("vision.", "aligner.", "image_")
#: the drafter's embedding and head (shared with the target by vLLM's speculator)
DRAFTER_SHARED = {"model.embed_tokens.weight", "lm_head.weight"}
#: what vLLM's check names for the bundle before the vision stand-in (the H100 log)
GPU_LOG_MISSING = {"image_end", "image_start", "vision.norm.weight", "image_newline"}

pytestmark = pytest.mark.skipif(
    not BUNDLED.is_dir(), reason="models/dsv41-pair not bundled in this checkout"
)

#: (model, PP rank, PP size, engine arguments)
CASES = {
    "target-pp1": ("target", 0, 1, {}),
    "target-pp2-stage0": ("target", 0, 2, {}),
    "target-pp2-stage1": ("target", 1, 2, {}),
    "target-language-model-only": ("target", 0, 1, {"language_model_only": True}),
    "drafter": ("drafter", 0, 1, {}),
    "context-kv-drafter": ("context", 0, 1, {}),
}


def _load(model_dir: Path, case: str, monkeypatch) -> tuple[set[str], str | None]:
    """Build ``case``'s model for ``model_dir`` on CPU, load its checkpoint with vLLM's
    ``DefaultModelLoader.load_weights`` (vLLM's check included) and return the names the model
    registers that no checkpoint tensor filled, and vLLM's verdict (None: it passed)."""
    import vllm.model_executor.models.utils as vllm_utils
    from vllm.config import LoadConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.models.deepseek_v41.nvidia.dspark import DSparkDeepseekV4ForCausalLM

    from vllm_dspark_pp.producer import deepseek_v41

    # vLLM caches each model's PP-missing layers by id(model): in one process a model built here
    # can get the id of an earlier test's (freed) one and inherit its missing layers
    monkeypatch.setattr(vllm_utils, "_model_to_pp_missing_layer_names", {})
    which, rank, size, kw = CASES[case]
    pair = v41.t.TinyPair(str(model_dir), str(model_dir), "dsv41-pair")
    cfg = v41.engine_config(pair, pp=1, **kw)
    if which == "target":
        model, model_config = v41.build_stage(cfg, rank, size, monkeypatch), cfg.model_config
    else:
        cls = DSparkDeepseekV4ForCausalLM
        if which == "context":
            cls = deepseek_v41.DSparkDeepseekV41ContextKVForCausalLM
        model = v41.build_drafter(cfg, cls, monkeypatch)
        model_config = cfg.speculative_config.draft_model_config
    loader = DefaultModelLoader(LoadConfig(load_format="safetensors"))
    loaded: set[str] = set()
    real = model.load_weights

    def recording(weights):
        out = real(weights)
        loaded.update(out)
        return out

    monkeypatch.setattr(model, "load_weights", recording)
    verdict = None
    with set_current_vllm_config(cfg), v41.as_stage(monkeypatch, rank, size), torch.no_grad():
        try:
            loader.load_weights(model, model_config)
        except ValueError as e:
            verdict = str(e)
    shared = DRAFTER_SHARED if which != "target" else set()
    return tp_load.registered(model) - loaded - shared, verdict


def _missing(verdict: str | None) -> set[str]:
    """The names in vLLM's ``Following weights were not initialized from checkpoint: {...}``."""
    import ast

    head = "Following weights were not initialized from checkpoint: "
    assert verdict is not None and verdict.startswith(head), verdict
    return ast.literal_eval(verdict[len(head) :])


@pytest.mark.parametrize("case", list(CASES))
def test_bundled_pair_passes_vllms_weight_check(plugin, dist_env, case, monkeypatch):
    unfilled, verdict = _load(BUNDLED, case, monkeypatch)
    assert verdict is None
    assert unfilled == set()


def _before_the_stand_in(tmp: Path) -> Path:
    """A copy of the bundle without ``vision_config`` and the vision tensors: the bundle as
    trained (commit 6abdbbd)."""
    from safetensors.torch import load_file, save_file

    d = tmp / "dsv41"
    shutil.copytree(BUNDLED, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("vision_config", None)
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    sd = load_file(str(d / "model.safetensors"))
    sd = {k: v for k, v in sd.items() if not k.startswith(VISION_PREFIXES)}
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize(
    "case, missing",
    [
        ("target-pp1", GPU_LOG_MISSING),
        ("target-pp2-stage0", GPU_LOG_MISSING),
        ("target-pp2-stage1", {"image_end", "image_start", "image_newline"}),
        ("target-language-model-only", {"image_end", "image_start", "image_newline"}),
    ],
)
def test_the_checkpoint_before_the_vision_stand_in_fails(
    plugin, dist_env, case, missing, monkeypatch, tmp_path
):
    """Control: vLLM's check refuses the bundle without the vision stand-in as the H100 did, and
    the name comparison sees the vision projections vLLM's check exempts."""
    unfilled, verdict = _load(_before_the_stand_in(tmp_path), case, monkeypatch)
    assert _missing(verdict) == missing
    stage0 = CASES[case][1] == 0 and "language_model_only" not in CASES[case][3]
    projections = {
        "vision.patch_embed.proj.weight",
        "vision.patch_embed.proj.bias",
        "aligner.w1.weight",
        "aligner.w1.bias",
        "aligner.w2.weight",
        "aligner.w2.bias",
    }
    assert unfilled == missing | (projections if stage0 else set())


def test_the_gpu_engines_start_text_only_so_no_image_encoder_is_profiled():
    """The second start failure the H100 would hit after weight loading: on the first PP rank
    vLLM profiles the image encoder of a model that ``supports_multimodal_inputs`` (vLLM 0.34.0
    ``v1/worker/gpu/model_runner.py`` ``profile_run``), with dummy images whose placeholder token
    the tiny tokenizer lacks. The V4.1 GPU engines pass ``mla_pairs.engine_kwargs("dsv41")``
    (``language_model_only``); control: without it the same config supports image inputs."""
    from support import mla_pairs

    pair = v41.t.TinyPair(str(BUNDLED), str(BUNDLED), "dsv41-pair")
    assert v41.engine_config(pair, pp=1).model_config.supports_multimodal_inputs  # the control
    kw = mla_pairs.engine_kwargs("dsv41")
    assert kw == {"language_model_only": True}
    assert mla_pairs.serve_args("dsv41") == ["--language-model-only"]
    cfg = v41.engine_config(pair, pp=1, **kw)
    assert not cfg.model_config.supports_multimodal_inputs
