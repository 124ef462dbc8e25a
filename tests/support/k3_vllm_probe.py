"""Child of test_k3_equivalence.py: vLLM 0.34.0's own Kimi-K3 modules on CPU, fed the exported
tiny K3 pair, against the pure-torch training modules (dspark_dev/training/k3_models.py).

vLLM's CPU engine cannot serve Kimi-K3 in 0.34.0 (see the test's docstring), so this builds vLLM's
``KimiLinearForCausalLM`` and ``K3DSparkForCausalLM`` in one process (no engine), loads the
exported safetensors through their ``load_weights`` and composes each forward from vLLM's own
layers: embeddings, RMSNorms, every linear (fused / stacked as vLLM loads them), the KDA
projections split as ``KimiK3DeltaAttention.forward`` splits them, vLLM's ``causal_conv1d_update``
for the short convolution, vLLM's ``fused_recurrent_kda`` Triton kernel (Triton's interpreter) for
the KDA recurrence, ``o_norm``, the MoE and dense MLPs, the drafter's context projection, RoPE
module, Markov and confidence heads. One piece is reference code here, not vLLM's kernel: the MLA
softmax (a plain softmax over the queries / keys / values vLLM's modules produce, with the layer's
``scale``; the prefill/absorbed-decode kernels compute the same attention).

Writes JSON: the names vLLM did not load, and per component the max |difference| to the training
module's output, plus the greedy tokens of both targets.

usage: k3_vllm_probe.py PAIR_DIR OUT_JSON [MUTATION]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")  # its CuTe DSL kernel (cutlass) is GPU-only

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _interpretable_kda_kernels() -> None:
    """Triton's interpreter patches ``tl.exp``/``tl.log`` on the ``tl`` module at run time; the KDA
    kernel module bound them to module globals at import (``fla/ops/op.py``), which the
    interpreter then cannot run. Re-bind those globals to late lookups."""
    import vllm.models.kimi_k3.nvidia.ops.third_party.kda.fused_recurrent as fr
    from vllm.triton_utils import tl

    fr.exp = lambda x: tl.exp(x)
    fr.log = lambda x: tl.log(x)


def _dist(cfg) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    path = tempfile.mktemp(prefix="dspark-k3-probe-")
    with set_current_vllm_config(cfg):
        init_distributed_environment(1, 0, f"file://{path}", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)


def _repack(model) -> None:
    """The CPU linear post-load step (sets the packed GEMM the forward calls)."""
    for m in model.modules():
        method = getattr(m, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(m)


def _load(model, path: str) -> list[str]:
    from safetensors.torch import load_file

    sd = {k: v.float() for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    loaded = model.load_weights(iter(sd.items()))
    return sorted({n for n, _ in model.named_parameters()} - set(loaded))


def _mla_ref_attention(attn, h, cos_sin=None, positions=None, ctx=None, mask=None):
    """vLLM's MLA layer ``attn`` on hidden ``h`` [T,H] with its own modules; the softmax is plain
    reference code. ``ctx`` = (context states [C,H], context positions) adds context keys (the
    drafter: the layer's kv_a_proj_with_mqa rows of ``context_kv_proj`` are what vLLM writes)."""
    qr, kvr, rr = attn.q_lora_rank, attn.kv_lora_rank, attn.qk_rope_head_dim
    nh, nope, vd = attn.num_local_heads, attn.qk_nope_head_dim, attn.v_head_dim
    q_c, kv_c, k_pe = attn.fused_qkv_a_proj(h)[0].split([qr, kvr, rr], -1)
    q = attn.q_b_proj(attn.q_a_layernorm(q_c))[0].view(-1, nh, nope + rr)
    kv_c_n = attn.kv_a_layernorm(kv_c)
    if attn.rotary_emb is not None:
        q_pe, k_pe = attn.rotary_emb.forward_native(
            positions, q[..., nope:].contiguous(), k_pe.unsqueeze(1).contiguous()
        )
        q = torch.cat([q[..., :nope], q_pe.view(-1, nh, rr)], -1)
        k_pe = k_pe.view(-1, rr)
    if ctx is not None:
        c_kv_c, c_k_pe = ctx
        kv_c_n = torch.cat([c_kv_c, kv_c_n], 0)
        k_pe = torch.cat([c_k_pe, k_pe], 0)
    kv = attn.kv_b_proj(kv_c_n)[0].view(-1, nh, nope + vd)
    k = torch.cat([kv[..., :nope], k_pe.unsqueeze(1).expand(-1, nh, rr)], -1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * attn.scale
    if mask is None:
        T = h.shape[0]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
    s = s.masked_fill(~mask, float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), kv[..., nope:].float())
    return attn.o_proj(o.reshape(-1, nh * vd).to(h.dtype))[0]


def _kda(attn, h):
    """``KimiK3DeltaAttention.forward`` from vLLM's modules, for one fresh sequence h [T,H]."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
    from vllm.models.kimi_k3.nvidia.ops.third_party.kda import fused_recurrent_kda

    T = h.shape[0]
    P, d, nh = attn.local_projection_size, attn.head_dim, attn.local_num_heads
    split = [3 * P, P, d, nh] + ([attn.in_proj_padding] if attn.in_proj_padding else [])
    mixed_qkv, g2, f_a, beta = attn.in_proj_qkvgfab(h)[0].split(split, -1)[:4]
    g1 = attn.f_b_proj(f_a)[0]
    w = attn.conv1d.weight.view(attn.conv1d.weight.size(0), attn.conv1d.weight.size(2))
    # the multi-token conv update from a zero state (slot 1; slot 0 is the null block) is the
    # prefill convolution of a fresh sequence
    conv_state = torch.zeros(2, w.shape[0], w.shape[1] - 1)
    qkv = causal_conv1d_update(
        mixed_qkv.t().unsqueeze(0).contiguous(),
        conv_state,
        w,
        attn.conv1d.bias,
        activation="silu",
        conv_state_indices=torch.tensor([1], dtype=torch.int32),
    )[0].t()
    q, k, v = (x.reshape(1, T, nh, d) for x in qkv.split(P, -1))
    state = torch.zeros(2, nh, d, d)
    idx = torch.full((1, T), -1, dtype=torch.int32)
    idx[0, 0] = 1  # state slot 1 (zeros); slot 0 is vLLM's null block
    o, _ = fused_recurrent_kda(
        q=q.contiguous(),
        k=k.contiguous(),
        v=v.contiguous(),
        raw_g=g1.reshape(1, T, nh, d).contiguous(),
        raw_beta=beta.reshape(1, T, nh).contiguous(),
        A_log=attn.A_log,
        dt_bias=attn.dt_bias,
        lower_bound=attn.gate_lower_bound,
        initial_state=state,
        cu_seqlens=torch.tensor([0, T], dtype=torch.int32),
        ssm_state_indices=idx,
        num_accepted_tokens=None,
    )
    o = attn.o_norm.forward_native(o.view(1, T, nh, d), g2.reshape(1, T, nh, d))
    return attn.o_proj(o.reshape(T, P))[0]


def main(pair: str, out_json: str, mutation: str = "") -> int:
    import vllm.v1.worker.cpu.shm  # noqa: F401  the CPU worker's torch.cuda stand-ins
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import set_forward_context

    from dspark_dev.training import k3_models
    from dspark_dev.training.export import K3_DRAFT_DIR, K3_TARGET_DIR, load_k3_pair

    _interpretable_kda_kernels()
    torch.manual_seed(0)
    tdir, ddir = os.path.join(pair, K3_TARGET_DIR), os.path.join(pair, K3_DRAFT_DIR)
    # the training modules as they were exported (their own parameter layout, not re-read
    # through export.load_k3_pair, which would mirror a layout slip of the exporter)
    state_path = os.path.join(pair, "training_state.pt")
    if os.path.exists(state_path):
        with open(os.path.join(ddir, "training.json")) as f:
            extra = json.load(f)
        tcfg = k3_models.K3TargetConfig(**extra["target_config"])
        dcfg = k3_models.K3DraftConfig(**extra["draft_config"])
        target, draft = k3_models.TinyK3(tcfg), k3_models.TinyK3DSpark(tcfg, dcfg)
        state = torch.load(state_path, weights_only=True)
        target.load_state_dict(state["target"])
        draft.load_state_dict(state["draft"])
    else:  # a pair written by train_tiny_pair (by hand: python k3_vllm_probe.py PAIR OUT)
        target, draft = load_k3_pair(pair)
    if mutation == "no-conv":  # the control: a training KDA without the short convolution
        k3_models.KDA.short_conv = staticmethod(lambda x, w: F.silu(x))
    elif mutation == "neox-rope":  # the control: the drafter's RoPE in the NeoX layout
        from dspark_dev.training.models import apply_rope

        k3_models.apply_rope_interleaved = apply_rope
    target.eval()
    draft.eval()

    cfg = EngineArgs(
        model=tdir,
        speculative_config={"method": "dspark", "model": ddir, "num_speculative_tokens": 7},
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        enforce_eager=True,
        enable_prefix_caching=False,
        mamba_ssm_cache_dtype="float32",
    ).create_engine_config()
    _dist(cfg)
    from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkForCausalLM
    from vllm.models.kimi_k3.nvidia.model import KimiLinearForCausalLM

    with set_current_vllm_config(cfg), torch.device("cpu"):
        vt = KimiLinearForCausalLM(vllm_config=cfg, prefix="")
        vd = K3DSparkForCausalLM(vllm_config=cfg, prefix="")
    rep: dict = {"unloaded_target": _load(vt, tdir), "unloaded_draft": _load(vd, ddir)}
    vd.model.embed_tokens = vt.model.embed_tokens  # the speculator shares the target's
    _repack(vt)
    _repack(vd)
    diffs: dict[str, float] = {}
    scales: dict[str, float] = {}

    def diff(name, a, b):
        """vLLM's ``a`` vs the training module's ``b``: the max |a - b| and the max |b|."""
        diffs[name] = max(diffs.get(name, 0.0), float((a.float() - b.float()).abs().max()))
        scales[name] = max(scales.get(name, 0.0), float(b.float().abs().max()))

    ids = torch.randint(3, target.cfg.vocab_size, (1, 24))
    aux_ids = draft.aux_layer_ids
    with torch.no_grad(), set_current_vllm_config(cfg), set_forward_context(None, cfg):
        # ---- target: the pure-torch forward vs vLLM's layers composed ----
        logits, _, aux = target(ids, aux_ids)
        x = vt.model.embed_tokens(ids[0])
        v_aux = []
        for i, (layer, mine) in enumerate(zip(vt.model.layers, target.layers, strict=True)):
            if i in aux_ids:
                v_aux.append(x)
            h = layer.input_layernorm(x)
            if mine.is_kda:
                a = _kda(layer.self_attn, h)
                diff("kda", a, mine.self_attn(h.unsqueeze(0))[0])
            else:
                a = _mla_ref_attention(layer.self_attn, h)
                m = mine.self_attn
                hh = h.unsqueeze(0)
                diff("mla_nope", a, m.attend(m.q_of(hh), *m.kv_of(hh), causal=True)[0])
            x = x + a
            h = layer.post_attention_layernorm(x)
            f = layer.mlp(h)
            diff(
                "moe" if mine.is_moe else "dense_mlp",
                f,
                (mine.block_sparse_moe if mine.is_moe else mine.mlp)(h),
            )
            x = x + f
        if len(vt.model.layers) in aux_ids:
            v_aux.append(x)
        v_logits = vt.compute_logits(x)
        diff("target_logits", v_logits, logits[0])
        rep["greedy_vllm_modules"] = v_logits.argmax(-1).tolist()
        rep["greedy_training"] = logits[0].argmax(-1).tolist()
        for j, (va, ma) in enumerate(zip(v_aux, aux, strict=True)):
            diff(f"aux{j}", va, ma[0])

        # ---- drafter: one block anchored at a, on the training target's aux states ----
        a_pos, N = 17, draft.dcfg.block_size
        ctx_mine = draft.context(aux)
        ctx_v = vd.combine_hidden_states(torch.cat([t[0] for t in aux], -1))
        diff("draft_context", ctx_v, ctx_mine[0])
        seq = torch.cat([ids, ids.new_zeros(1, N)], 1)
        ctx_pad = torch.cat([ctx_mine, ctx_mine.new_zeros(1, N, ctx_mine.shape[-1])], 1)
        d_logits, d_conf, _ = draft(seq, ctx_pad, torch.tensor([[a_pos]]), target.lm_head_weight)
        blk = torch.full((N,), draft.dcfg.mask_token_id, dtype=torch.long)
        blk[0] = ids[0, a_pos]
        qpos = torch.arange(a_pos, a_pos + N)
        cpos = torch.arange(a_pos)
        x = vd.embed_input_ids(blk)
        all_kv = vd.model.context_kv_proj(ctx_v[:a_pos])
        width = vd.model.layers[0].self_attn.kv_lora_rank
        mask = torch.ones(N, a_pos + N, dtype=torch.bool)
        residual = None
        for li, layer in enumerate(vd.model.layers):
            attn = layer.self_attn
            kv = all_kv.view(a_pos, len(vd.model.layers), -1)[:, li]
            c_kv_c = attn.kv_a_layernorm(kv[:, :width].contiguous())
            _, c_k_pe = attn.rotary_emb.forward_native(
                cpos,
                kv[:, width:].unsqueeze(1).contiguous(),
                kv[:, width:].unsqueeze(1).contiguous(),
            )
            if residual is None:
                residual, h = x, layer.input_layernorm(x)
            else:
                residual = x + residual
                h = layer.input_layernorm(residual)
            x = _mla_ref_attention(
                attn, h, positions=qpos, ctx=(c_kv_c, c_k_pe.view(a_pos, -1)), mask=mask
            )
            residual = x + residual
            x = layer.mlp(layer.post_attention_layernorm(residual))
        hidden = vd.model.final_norm(x + residual)
        base = vd.logits_processor(vt.lm_head, hidden)  # the target's lm_head, no norm
        prev = seq[0, a_pos : a_pos + N]  # teacher-forced Markov input, as the training forward
        memb = vd.model.markov_head.embed(prev)
        v_draft = base + vd.model.markov_head.bias(memb, vd.logits_processor)
        diff("draft_logits", v_draft, d_logits[0, 0])
        diff("draft_confidence", vd.model.confidence_head(hidden, memb), d_conf[0, 0])
        rep["draft_greedy_vllm_modules"] = v_draft.argmax(-1).tolist()
        rep["draft_greedy_training"] = d_logits[0, 0].argmax(-1).tolist()
    rep["max_abs_diff"] = diffs
    rep["max_abs_training"] = scales
    with open(out_json, "w") as f:
        json.dump(rep, f, indent=2)
    print(json.dumps(rep, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
