"""``pd_control_sim`` on the bundled DeepSeek-V4 pair (models/dsv4-pair): the training modules
rebuilt from the one checkpoint (``dsv4_train.load_dsv4_pair``) give back every tensor exactly,
and the simulator's perturbed draft context is the one a draft loaded from the GPU control's
checkpoint (``support.draft_controls.aux_perturbed_draft``) computes: the CPU estimate and the
GPU control change the same tensor the same way. No engine, no generation: about 3 s."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.draft_controls import SUBTLE_PERTURB, aux_perturbed_draft

from dspark_dev.training.dsv4_train import DSV4_DIR, dsv4_checkpoint, load_dsv4_pair
from dspark_dev.training.pd_control_sim import perturbed_context

PAIR = Path(__file__).resolve().parents[4] / "models" / "dsv4-pair"


@pytest.fixture(scope="module")
def pair():
    return load_dsv4_pair(str(PAIR))


def test_load_dsv4_pair_gives_back_every_checkpoint_tensor(pair):
    target, draft = pair
    sd = load_file(str(PAIR / DSV4_DIR / "model.safetensors"))
    back = dsv4_checkpoint(target, draft)
    assert sorted(back) == sorted(sd)
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


@pytest.mark.parametrize("perturb", [SUBTLE_PERTURB, "scale:-1:0.5"])
def test_simulated_perturbation_is_the_gpu_controls_checkpoint(tmp_path, pair, perturb):
    target, draft = pair
    control = Path(aux_perturbed_draft(str(PAIR / DSV4_DIR), str(tmp_path), perturb))
    shutil.move(str(control), str(tmp_path / "pair" / DSV4_DIR))
    _, bad = load_dsv4_pair(str(tmp_path / "pair"))
    g = torch.Generator().manual_seed(0)
    h = target.cfg.hidden_size
    aux = [torch.randn(1, 5, h, generator=g) for _ in draft.aux_layer_ids]
    with torch.no_grad():
        simulated = perturbed_context(draft, aux, perturb)
        loaded = bad.context(aux)
        real = draft.context(aux)
    assert torch.equal(simulated, loaded)
    assert not torch.equal(simulated, real)
