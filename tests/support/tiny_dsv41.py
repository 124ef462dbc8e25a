"""A tiny DeepSeek-V4.1 target (its DSpark drafter in the same checkpoint) and its pipeline stages
built on CPU, for the PP relay and producer tests (issue 42).

Generated, never downloaded. The config is the tiny DeepSeek-V4 GPU geometry
(``tiny_mla_targets.dsv4_fields(gpu=True)``: the widths vLLM's CUDA attention classes are built
for) with what vLLM 0.34.0's V4.1 code reads instead (``model_type`` ``deepseek_v41``,
``compress_ratios`` with one entry per layer, MTP stages included, ``kv_source_layer_ids`` /
``index_source_layer_ids``; deepseek_v41/attention.py:375-412) and four layers, so that PP=2 and
PP=4 both split it. The taps ``[1, 2, 3]`` (V4.1 reads layer ``L``'s input stream, the ids are
used as they are: eagle3_utils.py:115-121) put one tap on each side of the PP=2 boundary and one
on it (layer 2's input is stage 0's last output).

A stage is vLLM's CUDA model class constructed on CPU with a stand-in PP group (the rank and size
``make_layers`` and the first/last-rank questions read) in the one-process world of the
``dist_env`` fixture, and the constructor's CUDA-only calls answered (streams, events, the FP8
einsum recipe, which asserts a CUDA device: deepseek_v4/nvidia/ops/o_proj.py:33).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dspark_dev import tiny_mla_targets as t
from vllm_dspark_pp.tiny_models import _write_json, _write_tokenizer

NUM_LAYERS = 4
TAPS = [1, 2, 3]
DRAFT_ARCH = "DSparkV41DraftModel"


def dsv41_fields() -> dict[str, Any]:
    out = t.dsv4_fields(gpu=True)
    # V4's layer typing; V4.1 reads compress_ratios (0: sliding window only)
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "transformers_version"):
        out.pop(key, None)
    n_mtp = out["n_mtp_layers"]
    out.update(
        architectures=["DeepseekV41ForCausalLM"],
        model_type="deepseek_v41",
        num_hidden_layers=NUM_LAYERS,
        compress_ratios=[0, 1, 0, 0] + [0] * n_mtp,
        kv_source_layer_ids=[1],
        index_source_layer_ids=[1],
        dspark_target_layer_ids=list(TAPS),
    )
    return out


def make_tiny_dsv41_pair(out: str | Path, **edits: Any) -> t.TinyPair:
    """One directory used as target and draft (the V4.1 drafter ships in the target)."""
    path = Path(out) / "dsv41"
    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path, t.VOCAB)
    _write_json(path / "config.json", {**dsv41_fields(), **edits})
    _write_json(path / "generation_config.json", {"eos_token_id": 2})
    return t.TinyPair(str(path), str(path), "deepseek-v4.1")


def config_json(pair: t.TinyPair) -> dict[str, Any]:
    return json.loads((Path(pair.target) / "config.json").read_text())


def engine_config(pair: t.TinyPair, *, pp: int = 2, **kw: Any) -> Any:
    """A real VllmConfig for the pair with DSpark (dummy weights, no engine started)."""
    from dspark_dev import tiny_dsv4_cpu

    args: dict[str, Any] = dict(
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp",
        speculative_config=pair.speculative_config(4),
    )
    args.update(kw)
    return tiny_dsv4_cpu.engine_config(pair, **args)


class StagePP:
    """vLLM's PP group as stage ``rank`` of ``size`` sees it; everything else is the real
    (one-process) group's."""

    def __init__(self, real: Any, rank: int, size: int) -> None:
        self._real, self.rank_in_group, self.world_size = real, rank, size

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def as_stage(monkeypatch: Any, rank: int, size: int) -> Iterator[None]:
    """Inside the block vLLM's ``get_pp_group()`` answers as stage ``rank`` of ``size``."""
    from vllm.distributed import parallel_state as ps

    with monkeypatch.context() as m:
        m.setattr(ps, "_PP", StagePP(ps.get_pp_group(), rank, size))
        yield


@contextlib.contextmanager
def cuda_stand_ins(monkeypatch: Any, cfg: Any) -> Iterator[None]:
    """Construction of vLLM's CUDA V4.1 classes on CPU into ``cfg`` (a fresh layer registry):
    streams, events and the FP8 einsum recipe answered, a one-rank EP group for the MoE."""
    import vllm.models.deepseek_v41.nvidia.flashmla as flashmla
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    cfg.compilation_config.static_forward_context = {}
    with monkeypatch.context() as m, set_current_vllm_config(cfg), torch.device("cpu"):
        if ps._EP is None:  # the one-rank world was set up for a dense model
            m.setattr(ps, "_EP", ps.get_tp_group())
        m.setattr(torch.cuda, "Stream", lambda *a, **k: None)
        m.setattr(torch.cuda, "Event", lambda *a, **k: None)
        m.setattr(flashmla, "compute_fp8_einsum_recipe", lambda *a, **k: (None, False))
        yield


def build_stage(cfg: Any, rank: int, size: int, monkeypatch: Any) -> Any:
    """vLLM's ``DeepseekV41ForCausalLM`` (the CUDA implementation) as PP stage ``rank``."""
    from vllm.models.deepseek_v41.nvidia.vl_model import DeepseekV41ForCausalLM

    with cuda_stand_ins(monkeypatch, cfg), as_stage(monkeypatch, rank, size):
        return DeepseekV41ForCausalLM(vllm_config=cfg, prefix="")


def build_drafter(cfg: Any, cls: type, monkeypatch: Any) -> Any:
    """A DSpark drafter class (vLLM's full V4.1 drafter or the context-only one) built on CPU."""
    with cuda_stand_ins(monkeypatch, cfg):
        return cls(vllm_config=cfg, prefix="")


def checkpoint_shapes(hf: Any) -> dict[str, tuple[int, ...]]:
    """The tiny checkpoint's tensors in V4.1 naming: DeepSeek-V4's (tiny_mla_drafts) without
    what V4.1 has not (the learned ``hc_head_*``, the confidence head's bias)."""
    from dspark_dev import tiny_mla_drafts

    return {
        k: v
        for k, v in tiny_mla_drafts.dsv4_checkpoint_shapes(hf).items()
        if "hc_head" not in k and "confidence_head.proj.bias" not in k
    }
