"""Child process of tests/gpu/test_context_kv_mla_gpu.py (one family per process, CUDA).

Usage: python _context_kv_mla_child.py {dsv4|k3} <tiny-target-dir> <tiny-draft-dir> <out.json>

Builds vLLM 0.34.0's full DSpark drafter and our context-KV-only drafter for one family from a
tiny generated config (dspark_dev.tiny_mla_drafts), directly under set_current_vllm_config
(no engine: a DeepSeek-V4 / Kimi-K3 *target* is not needed to construct or run the drafters'
context path), and records every check in a JSON report. Each step is recorded as passed or with
its traceback, so the parent test fails naming the step (a construction failure is a failure,
never a skip).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
import types

FAMILY, TARGET_DIR, DRAFT_DIR, OUT = sys.argv[1:5]
report: dict = {"family": FAMILY, "steps": {}, "facts": {}}


def save() -> None:
    with open(OUT, "w") as f:
        json.dump(report, f, indent=1, default=str)


def step(name):
    def deco(fn):
        try:
            value = fn()
            report["steps"][name] = {"ok": True}
            return value
        except Exception:  # noqa: BLE001 - recorded, the parent fails on it
            report["steps"][name] = {"ok": False, "error": traceback.format_exc()[-6000:]}
            save()
            raise SystemExit(0) from None
        finally:
            save()

    return deco


import torch  # noqa: E402

import vllm_dspark_pp  # noqa: E402

vllm_dspark_pp.register()

from vllm.config import KVTransferConfig, set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402

from dspark_dev import tiny_mla_drafts as tiny  # noqa: E402
from vllm_dspark_pp.producer import deepseek_v4, drafter, families, kimi_k3  # noqa: E402

# DSPARK_CHILD_DEVICE=cpu: a CPU dry run of this script's own logic (vLLM's DeepSeek-V4 drafter
# does not build on CPU and the K3 insert needs the CUDA grouped op: those steps fail there).
DEV = torch.device(os.environ.get("DSPARK_CHILD_DEVICE", "cuda"))
BACKEND = "nccl" if DEV.type == "cuda" else "gloo"
BF16 = torch.bfloat16


@step("engine_config")
def base_cfg():
    args = EngineArgs(
        model=TARGET_DIR,
        speculative_config={"method": "dspark", "model": DRAFT_DIR},
        kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_producer"),
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        enforce_eager=True,
    )
    return args.create_engine_config()


@step("distributed_init")
def _dist():
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        get_world_group,
        init_distributed_environment,
    )
    from vllm.distributed import parallel_state as ps

    with set_current_vllm_config(base_cfg):
        init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, BACKEND)
        ensure_model_parallel_initialized(1, 1)
        if ps._EP is None:
            # the tiny Qwen3 config the engine config came from is dense, so vLLM made no EP
            # group; the DeepSeek-V4 MoE layers of the full drafter need one (world of 1)
            ps._EP = ps.init_model_parallel_group(
                [[0]], get_world_group().local_rank, BACKEND, group_name="ep"
            )
    from vllm.v1.worker.workspace import init_workspace_manager

    init_workspace_manager(DEV)


if FAMILY == "dsv4":
    from vllm.models.deepseek_v4.nvidia.dspark import DSparkDeepseekV4ForCausalLM as FULL

    DRAFT = tiny.tiny_dsv4_config(gpu=True)
    TARGET = DRAFT  # the DeepSeek-V4 drafter's layers read the target config (same checkpoint)
    CTX_CLS_FN = lambda: families.context_kv_class_for(_spec_with("DSparkDraftModel"))  # noqa: E731
    SHAPES = tiny.dsv4_checkpoint_shapes(DRAFT)
    CONTEXT_NAMES = tiny.DSV4_CONTEXT_NAMES
else:
    from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkForCausalLM as FULL

    DRAFT = tiny.tiny_k3_config(gpu=True)
    TARGET = None  # the tiny Qwen3 target (K3 reads only its layer count)
    CTX_CLS_FN = lambda: families.context_kv_class_for(_spec_with("K3DSparkModel"))  # noqa: E731
    SHAPES = tiny.k3_checkpoint_shapes(DRAFT)
    CONTEXT_NAMES = tiny.K3_CONTEXT_NAMES


def _spec_with(arch):
    """What the routing reads of a speculative config: the draft's architectures."""
    assert DRAFT.architectures == [arch]
    return types.SimpleNamespace(draft_model_config=types.SimpleNamespace(architectures=[arch]))


def _k3_target():
    """The tiny Qwen3 target config carrying the draft's MLA dimensions: vLLM picks the MLA
    prefill backend from the *target* model config (``get_mla_dims``), and a real Kimi-K3 target
    is an MLA model with the same dimensions."""
    import copy

    t = copy.copy(base_cfg.model_config.hf_config)
    for name in (
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "kv_lora_rank",
        "q_lora_rank",
    ):
        setattr(t, name, getattr(DRAFT, name))
    return t


def build(cls):
    target = TARGET if TARGET is not None else _k3_target()
    cfg = tiny.shim_vllm_config(base_cfg, target_hf=target, draft_hf=DRAFT)
    with set_current_vllm_config(cfg), set_default_torch_dtype(BF16), DEV:
        model = cls(vllm_config=cfg, prefix="")
    return model, cfg


@step("build_full")
def full_pair():
    return build(FULL)


@step("route_and_build_context_only")
def ctx_pair():
    cls = CTX_CLS_FN()
    report["facts"]["context_class"] = cls.__name__
    return build(cls)


full, fcfg = full_pair
ctx, ccfg = ctx_pair


@step("context_only_tree")
def _tree():
    f_names = {n for n, _ in full.named_parameters()}
    c_names = sorted(n for n, _ in ctx.named_parameters())
    report["facts"]["context_params"] = c_names
    report["facts"]["full_param_count"] = len(f_names)
    report["facts"]["param_bytes"] = {
        "full": sum(p.numel() * p.element_size() for p in full.parameters()),
        "context_only": sum(p.numel() * p.element_size() for p in ctx.parameters()),
    }
    assert set(c_names) <= f_names, sorted(set(c_names) - f_names)
    banned = (
        "embed",
        "lm_head",
        "markov",
        "confidence",
        "ffn",
        "mlp",
        "wq_",
        "wo_",
        "q_norm",
        "q_a_",
        "q_b_",
        "kv_b_proj",
        "o_proj",
        "fused_qkv_a_proj",
        "fused_wqa_wkv",
        "hc_",
        "final_norm",
        "model.norm.",
        "input_layernorm",
        "post_attention_layernorm",
        "attn_norm",
        "ffn_norm",
        "attn_sink",
    )
    bad = [n for n in c_names if any(b in n for b in banned)]
    assert not bad, bad
    assert drafter.is_context_kv_only(ctx) and not drafter.is_context_kv_only(full)


@step("kv_layer_names_and_specs_equal")
def _specs():
    names = full.get_draft_kv_cache_layer_names()
    assert names == ctx.get_draft_kv_cache_layer_names(), (
        names,
        ctx.get_draft_kv_cache_layer_names(),
    )
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    # the attention-like layers vLLM derives KV-cache specs from (attn_utils.get_kv_cache_spec);
    # the full DeepSeek-V4 drafter also registers its MoE experts, which hold no KV
    f_layers = {
        n: m
        for n, m in fcfg.compilation_config.static_forward_context.items()
        if isinstance(m, AttentionLayerBase)
    }
    c_layers = dict(ccfg.compilation_config.static_forward_context)
    assert all(isinstance(m, AttentionLayerBase) for m in c_layers.values())
    assert sorted(f_layers) == sorted(c_layers), (sorted(f_layers), sorted(c_layers))
    specs = {}
    for n in sorted(f_layers):
        fs, cs = f_layers[n].get_kv_cache_spec(fcfg), c_layers[n].get_kv_cache_spec(ccfg)
        assert fs == cs, (n, fs, cs)
        assert f_layers[n].get_attn_backend() is c_layers[n].get_attn_backend(), n
        specs[n] = repr(fs)
    assert fcfg.cache_config.cache_dtype == ccfg.cache_config.cache_dtype
    report["facts"]["kv_layers"] = names
    report["facts"]["specs"] = specs
    report["facts"]["cache_dtype"] = fcfg.cache_config.cache_dtype


@step("skipped_weights")
def _skipped():
    names = sorted(SHAPES)
    filt = (
        deepseek_v4.is_dsv4_context_kv_weight
        if FAMILY == "dsv4"
        else kimi_k3.is_k3_context_kv_weight
    )
    kept = {n for n in names if filt(n)}
    assert kept == CONTEXT_NAMES, sorted(kept ^ CONTEXT_NAMES)
    report["facts"]["skipped_weights"] = sorted(set(names) - kept)


CKPT = tiny.make_checkpoint(
    {n: s for n, s in SHAPES.items() if n in CONTEXT_NAMES or FAMILY == "k3"},
    seed=7,
    dtype=BF16,
    device=DEV,
)


def _post_load(model):
    for name in ("main_proj", "context_wkv_proj", "context_proj", "context_kv_proj"):
        module = getattr(model.model, name, None)
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    if hasattr(model, "process_weights_after_loading"):
        model.process_weights_after_loading()


@step("load_weights")
def _load():
    f_loaded = full.load_weights(iter(CKPT.items()))
    c_loaded = ctx.load_weights(iter(CKPT.items()))
    report["facts"]["context_loaded"] = sorted(c_loaded)
    assert sorted(c_loaded) == sorted(n for n, _ in ctx.named_parameters())
    if FAMILY == "k3":
        assert f_loaded == {n for n, _ in full.named_parameters()}, "full K3 did not load all"
    pw, cw = (
        ("context_wkv_proj", "context_wkv_proj")
        if FAMILY == "dsv4"
        else ("context_kv_proj", "context_kv_proj")
    )
    assert torch.equal(getattr(full.model, pw).weight, getattr(ctx.model, cw).weight)
    _post_load(full)
    _post_load(ctx)
    # each weight held once after loading: nothing vLLM derived is a copy (issue 29 item 4)
    held = drafter.held_weight_bytes(ctx)
    params = sum(p.numel() * p.element_size() for p in ctx.parameters())
    report["facts"]["context_held_bytes"] = {"held": held, "parameters": params}
    assert held == params, report["facts"]["context_held_bytes"]


@step("context_kv_written_equal")
def _written():
    n_tok, n_blocks = 37, 4
    g = torch.Generator(device="cpu").manual_seed(11)
    in_dim = (
        DRAFT.hidden_size * len(DRAFT.dspark_target_layer_ids)
        if FAMILY == "dsv4"
        else DRAFT.target_hidden_size * DRAFT.num_target_layers
    )
    aux = (torch.randn(n_tok, in_dim, generator=g) * 0.5).to(BF16).to(DEV)
    positions = torch.arange(3, 3 + n_tok, device=DEV)

    def run(model, vcfg):
        caches = []
        if FAMILY == "dsv4":
            layers = vcfg.compilation_config.static_forward_context
            for name in model.get_draft_kv_cache_layer_names():
                spec = layers[name].get_kv_cache_spec(vcfg)
                cache = torch.zeros(
                    n_blocks,
                    spec.page_size_bytes // spec.dtype.itemsize,
                    dtype=spec.dtype,
                    device=DEV,
                )
                layers[name].kv_cache = cache
                caches.append(cache)
            block = 64
        else:
            block = vcfg.cache_config.block_size
            width = DRAFT.kv_lora_rank + DRAFT.qk_rope_head_dim
            for layer in model.model.layers:
                layer.self_attn.kv_cache = torch.zeros(
                    n_blocks, block, width, dtype=BF16, device=DEV
                )
                caches.append(layer.self_attn.kv_cache)
        slots = torch.randperm(n_blocks * block, generator=g)[:n_tok].to(DEV)
        with set_current_vllm_config(vcfg):
            states = model.combine_hidden_states(aux)
            model.precompute_and_store_context_kv(states, positions, [slots] * len(caches))
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        return caches

    g.manual_seed(12)
    f_caches = run(full, fcfg)
    g.manual_seed(12)
    c_caches = run(ctx, ccfg)
    for i, (f, c) in enumerate(zip(f_caches, c_caches, strict=True)):
        assert f.view(torch.uint8).any(), f"layer {i}: the full drafter wrote nothing"
        assert torch.equal(f.view(torch.uint8), c.view(torch.uint8)), f"layer {i} differs"
    report["facts"]["compared_cache_bytes"] = [int(f.numel() * f.element_size()) for f in f_caches]


@step("drafting_refused")
def _refused():
    for call in (
        "forward",
        "compute_logits",
        "markov_embed",
        "compute_confidence",
        "embed_input_ids",
    ):
        try:
            getattr(ctx, call)(torch.zeros(1, dtype=torch.long, device=DEV))
        except drafter.ContextOnlyDrafterError:
            continue
        raise AssertionError(f"{call} did not raise ContextOnlyDrafterError")


report["done"] = True
save()
