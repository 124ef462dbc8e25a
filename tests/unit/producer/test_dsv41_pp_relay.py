"""DeepSeek-V4.1 DSpark on a pipeline-parallel target (issue 42), on CPU: the patch
``models_deepseek_v41_nvidia_model`` (vLLM 0.34.0 refuses the combination at model load).

Each PP stage is vLLM's CUDA ``DeepseekV41ForCausalLM`` built on CPU (tests/support/tiny_dsv41.py)
and put through what a worker does with it at load (``set_eagle3_aux_hidden_state_layers`` with
PP, vLLM's check included; ``reserve_aux_intermediate_tensor_slots``; the relay keys of
``PPHandler``; ``maybe_share_target_embed``). The forward test runs vLLM's real decoder forward,
``_run_layers`` and ``_collapse`` of every stage with the decoder layers and the two mHC kernels
(TileLang/Triton, no CPU build) stood in by ones that write the id of the layer into each tensor,
so each tap that reaches the last stage says which layer's stream it is. The control without the
plugin runs in a subprocess (the patch cannot be taken off a process that applied it).

Here (not under tests/unit/): the stages need this directory's one-process world (``dist_env``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from support import tiny_dsv41 as v41

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return v41.make_tiny_dsv41_pair(tmp_path_factory.mktemp("dsv41"))


@pytest.fixture(scope="module")
def configs(pair, plugin, dist_env):
    return {pp: v41.engine_config(pair, pp=pp) for pp in (2, 4)}


def _load_stage(cfg, rank, size, monkeypatch):
    """Stage ``rank`` as a worker has it after load: built, aux taps set (vLLM's PP check)."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        aux_hidden_state_relay_keys,
        set_eagle3_aux_hidden_state_layers,
    )

    model = v41.build_stage(cfg, rank, size, monkeypatch)
    with v41.as_stage(monkeypatch, rank, size):
        set_eagle3_aux_hidden_state_layers(model, cfg.speculative_config, use_pp=True)
        relay = aux_hidden_state_relay_keys(model)
    return model, relay


def test_pp2_config_resolves_the_v41_drafter_and_its_taps(configs, pair):
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    cfg = configs[2]
    assert cfg.parallel_config.pipeline_parallel_size == 2
    draft = cfg.speculative_config.draft_model_config
    assert draft.architectures == [v41.DRAFT_ARCH]
    assert draft.hf_config.model_type == "deepseek_v41"
    # V4.1 taps are the ids as written (no +1), every one a real target layer
    assert get_eagle3_aux_layers_from_config(cfg.speculative_config) == tuple(v41.TAPS)
    assert v41.config_json(pair)["dspark_target_layer_ids"] == v41.TAPS
    # the drafter has no embedding of its own: the last stage must hold the target's
    assert draft.may_use_target_embed


@pytest.mark.parametrize("rank", [0, 1])
def test_each_stage_accepts_dspark_over_pp(configs, rank, monkeypatch):
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.models.deepseek_v41.nvidia.dspark import DSparkDeepseekV4ForCausalLM
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import maybe_share_target_embed

    model, relay = _load_stage(configs[2], rank, 2, monkeypatch)
    inner = model.get_language_model().model
    assert type(inner).supports_aux_hidden_states_over_pp is True
    assert (inner.start_layer, inner.end_layer) == ((0, 2) if rank == 0 else (2, 4))
    assert inner.aux_hidden_state_layers == tuple(v41.TAPS)
    assert relay == ()  # no middle stage at PP=2
    empty = model.make_empty_intermediate_tensors(3, torch.bfloat16, torch.device("cpu"))
    if rank == 0:
        assert set(empty.tensors) == {"hidden_states", "pre_mix"}
    else:  # the receive buffers: taps 1 and 2 come from stage 0
        assert set(empty.tensors) == {"hidden_states", "pre_mix", "aux_hidden_states_0",
                                      "aux_hidden_states_1"}  # fmt: skip
        assert empty["aux_hidden_states_1"].shape == (3, inner.config.hidden_size)
    # both stages hold the embedding: the first for the target, the last for the drafter
    assert isinstance(inner.embed_tokens, VocabParallelEmbedding)
    # vLLM's share step on this stage, for a drafter declared as V4.1's is
    draft = types.SimpleNamespace(
        has_own_embed_tokens=DSparkDeepseekV4ForCausalLM.has_own_embed_tokens
    )
    draft_inner = torch.nn.Module()
    draft_inner.embed_tokens = torch.nn.Embedding(4, 4)
    with v41.as_stage(monkeypatch, rank, 2):
        maybe_share_target_embed(draft, draft_inner, inner)
    assert draft_inner.embed_tokens is inner.embed_tokens


def _stand_in_kernels(monkeypatch):
    """Decoder layers and the mHC kernels replaced by id writers: layer ``i`` outputs streams of
    value ``i + 1`` (its post), and when asked for the previous layer's post (its input, the tap
    of layer ``i``) returns the value ``i``; the collapse keeps the stream's value."""
    import vllm.models.deepseek_v41.nvidia.model as m
    from vllm.model_executor.models.utils import extract_layer_index

    def layer_forward(self, x, positions, input_ids, pre_mix=None, post_mix=None, res_mix=None,
                      residual=None, *rest, capture_previous_aux=False, **kw):  # fmt: skip
        i = extract_layer_index(self.attn.prefix)
        n, hc, h = positions.shape[0], self.hc_mult, self.hidden_size
        out = torch.full((n, hc, h), float(i + 1))
        tap = None
        if capture_previous_aux and residual is not None:  # vLLM's: the fused pre has a post
            tap = torch.full((n, h), float(i))
        zeros = torch.zeros(n, hc)
        return out, torch.zeros_like(out), zeros, zeros, zeros, tap

    monkeypatch.setattr(m.DeepseekV4DecoderLayer, "forward", layer_forward)
    monkeypatch.setattr(m, "mhc_post_tilelang", lambda x, residual, post, res: x + residual)
    monkeypatch.setattr(m, "hc_collapse_triton", lambda x, pre_mix: x.mean(dim=1))


@pytest.mark.parametrize("size", [2, 4])
def test_taps_reach_the_last_stage_in_order(configs, size, monkeypatch):
    from vllm.sequence import IntermediateTensors
    from vllm.v1.worker.gpu.pp_utils import PPHandler

    stages = [_load_stage(configs[size], r, size, monkeypatch) for r in range(size)]
    _stand_in_kernels(monkeypatch)
    n = 5
    ids, positions = torch.arange(n), torch.arange(n)
    received: IntermediateTensors | None = None
    sent_keys = []
    for rank, (model, relay) in enumerate(stages):
        with v41.as_stage(monkeypatch, rank, size), torch.no_grad():
            out = model(ids, positions, received)
        if rank == size - 1:
            break
        assert isinstance(out, IntermediateTensors)
        # what vLLM's PP handler sends on: this stage's output plus the upstream taps it relays
        handler = types.SimpleNamespace(aux_hidden_state_relay_keys=relay)
        received = PPHandler.relay_aux_hidden_states(handler, received, out)
        sent_keys.append(sorted(received.tensors))
    hidden, taps = out
    assert hidden.shape == (n, configs[size].model_config.hf_config.hidden_size)
    # tap L is layer L's input stream, from whichever stage ran layer L - 1
    assert [t[0, 0].item() for t in taps] == [float(i) for i in v41.TAPS]
    assert all(t.shape == hidden.shape for t in taps)
    base = ["hidden_states", "pre_mix"]
    if size == 2:  # stage 0 captures tap 1 in layer 1's pre and tap 2 in its collapse
        assert sent_keys == [["aux_hidden_states_0", "aux_hidden_states_1", *base]]
    else:  # one layer a stage: each stage's collapse captures one tap, later ones relay it
        assert sent_keys == [
            ["aux_hidden_states_0", *base],
            ["aux_hidden_states_0", "aux_hidden_states_1", *base],
            ["aux_hidden_states_0", "aux_hidden_states_1", "aux_hidden_states_2", *base],
        ]


@pytest.mark.parametrize("size", [2, 4])
def test_taps_reach_the_last_stage_as_one_partial_sum(configs, size, monkeypatch, tmp_path):
    """The same forward with ``VLLM_DSPARK_PP_TAP_PARTIALS=1`` (protocol/tap_partials.py): each
    boundary carries ``dspark_tap_partial`` in place of the taps, and the last stage's first aux
    output is ``main_proj``'s columns of the upstream taps times those taps (the V4.1 relay patch
    collects it through the patched ``collect_remote_aux_hidden_states``)."""
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from vllm.config import set_current_vllm_config
    from vllm.sequence import IntermediateTensors
    from vllm.v1.worker.gpu.pp_utils import PPHandler

    from vllm_dspark_pp.protocol import tap_partials as tp

    monkeypatch.setenv("VLLM_DSPARK_PP_TAP_PARTIALS", "1")
    cfg = configs[size]
    stages = [_load_stage(cfg, r, size, monkeypatch) for r in range(size)]
    # the tiny pair ships no weights: the mode stays off, naming why (the fallback) ...
    with v41.as_stage(monkeypatch, 0, size), set_current_vllm_config(cfg):
        assert tp.configure_stage(types.SimpleNamespace(), stages[0][0], cfg) is None
    # ... so its draft checkpoint is a file holding main_proj as a V4.1 checkpoint names it
    h = cfg.model_config.hf_config.hidden_size
    g = torch.Generator().manual_seed(0)
    main_proj = torch.randn(h, len(v41.TAPS) * h, generator=g).to(torch.bfloat16)
    save_file({"mtp.0.main_proj.weight": main_proj}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(tp, "_checkpoint_dir", lambda spec, download_dir: str(tmp_path))
    handlers, plans = [], []
    for rank, (model, relay) in enumerate(stages):
        handler = types.SimpleNamespace(aux_hidden_state_relay_keys=relay)
        with v41.as_stage(monkeypatch, rank, size), set_current_vllm_config(cfg):
            plans.append(tp.configure_stage(handler, model, cfg))
            if rank:  # the receive buffers hold the partial instead of the taps
                keys = sorted(
                    model.make_empty_intermediate_tensors(2, torch.float32, "cpu").tensors
                )
                assert keys == ["dspark_tap_partial", "hidden_states", "pre_mix"], keys
        handlers.append(handler)
    assert all(p is not None for p in plans)
    _stand_in_kernels(monkeypatch)
    n = 5
    ids, positions = torch.arange(n), torch.arange(n)
    received: IntermediateTensors | None = None
    sent_keys = []
    for rank, (model, _) in enumerate(stages):
        with v41.as_stage(monkeypatch, rank, size), torch.no_grad():
            out = model(ids, positions, received)
            if rank == size - 1:
                break
            received = PPHandler.relay_aux_hidden_states(handlers[rank], received, out)
        sent_keys.append(sorted(received.tensors))
    assert sent_keys == [["dspark_tap_partial", "hidden_states", "pre_mix"]] * (size - 1)
    hidden, taps = out
    last = plans[-1]
    assert len(taps) == 1 + last.count
    # own taps as before; the first output is the partial sum of the upstream ones
    assert [t[0, 0].item() for t in taps[1:]] == [float(i) for i in v41.TAPS[last.base :]]
    weight = main_proj.to(taps[0].dtype)
    upstream = torch.cat([torch.full((n, h), float(i)) for i in v41.TAPS[: last.base]], -1)
    want = F.linear(upstream.to(weight.dtype), weight[:, : last.base * h])
    # bf16 partials, one rounding per stage: within 2% of the sums' scale
    tol = 2e-2 * want.abs().max().item()
    torch.testing.assert_close(taps[0], want, rtol=0, atol=tol)
    # control: the upstream taps against each other's columns (reversed) give another sum
    assert last.base >= 2
    swapped = torch.cat([torch.full((n, h), float(i)) for i in v41.TAPS[: last.base][::-1]], -1)
    wrong = F.linear(swapped.to(weight.dtype), weight[:, : last.base * h])
    assert not torch.allclose(taps[0], wrong, rtol=0, atol=tol)


_WITHOUT_PLUGIN = """
import tempfile
from support.env import set_cpu_env_defaults
set_cpu_env_defaults()
import pytest, torch
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, ensure_model_parallel_initialized
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import set_eagle3_aux_hidden_state_layers
from support import tiny_dsv41 as v41
cfg = v41.engine_config(v41.t.TinyPair({pair!r}, {pair!r}, "v41"), pp=2)
with set_current_vllm_config(cfg):
    init_distributed_environment(1, 0, "file://" + tempfile.mktemp(), 0, "gloo")
    ensure_model_parallel_initialized(1, 1)
mp = pytest.MonkeyPatch()
model = v41.build_stage(cfg, 1, 2, mp)
print("EMBED", type(model.get_language_model().model.embed_tokens).__name__)
with v41.as_stage(mp, 1, 2):
    set_eagle3_aux_hidden_state_layers(model, cfg.speculative_config, use_pp=True)
print("ACCEPTED")
"""


def test_vllm_without_the_plugin_refuses_v41_dspark_over_pp(pair):
    """The recorded control: stock vLLM 0.34.0 (no plugin: VLLM_PLUGINS names none) builds the
    last stage without an embedding and refuses DSpark over PP at load."""
    code = _WITHOUT_PLUGIN.format(pair=pair.target)
    path = os.pathsep.join(
        filter(None, [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH")])
    )
    env = dict(os.environ, VLLM_PLUGINS="none", PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert "ACCEPTED" not in out, out[-3000:]
    assert "EMBED PPMissingLayer" in out, out[-3000:]
    assert "does not support dspark with pipeline parallelism" in out, out[-3000:]
    assert "vllm-dspark-pp" not in proc.stdout
