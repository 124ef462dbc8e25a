"""vLLM 0.34.0's own Kimi-K3 modules on CPU (float32, one process, no engine), loaded with an
exported tiny K3 pair, and the forwards composed from them.

vLLM's CPU engine cannot serve Kimi-K3 in 0.34.0
(tests/unit/dspark_dev/training/test_k3_equivalence.py says why), so :class:`K3VllmPair` builds
vLLM's ``KimiLinearForCausalLM`` and ``K3DSparkForCausalLM`` directly, loads the checkpoints
through their ``load_weights``, shares the target's embeddings and ``lm_head`` with the drafter
through vLLM's own helpers (as ``load_dspark_model`` does), and runs:
embeddings, RMSNorms, every linear (fused / stacked as vLLM loads them), the KDA projections split
as ``KimiK3DeltaAttention.forward`` splits them, vLLM's ``causal_conv1d_update`` for the short
convolution, vLLM's ``fused_recurrent_kda`` Triton kernel (Triton's interpreter) for the KDA
recurrence, ``o_norm``, the MoE and dense MLPs, the drafter's context projection, context KV
projection, RoPE module, Markov and confidence heads, ``compute_logits`` of both models.

One piece is reference code here, not vLLM's kernel: the MLA softmax (a plain softmax over the
queries / keys / values vLLM's modules produce, with the layer's ``scale``; the prefill and
absorbed-decode kernels compute the same attention). What this does NOT exercise: the engine's
paged KV cache and Mamba-state cache, the scheduler, the attention backends' kernels, CUDA graphs,
bfloat16 arithmetic.

Users: tests/support/k3_vllm_probe.py (per-component equivalence with the training modules) and
``dspark_dev.training.k3_vllm_sim`` (greedy DSpark acceptance computed with these layers).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable

os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")  # its CuTe DSL kernel (cutlass) is GPU-only

import torch  # noqa: E402

# on_sublayer(layer index, kind, sublayer input, sublayer output); kind is one of "kda",
# "mla_nope", "moe", "dense_mlp"
SublayerHook = Callable[[int, str, torch.Tensor, torch.Tensor], None]


def interpretable_kda_kernels() -> None:
    """Triton's interpreter patches ``tl.exp``/``tl.log`` on the ``tl`` module at run time; the KDA
    kernel module bound them to module globals at import (``fla/ops/op.py``), which the
    interpreter then cannot run. Re-bind those globals to late lookups."""
    import vllm.models.kimi_k3.nvidia.ops.third_party.kda.fused_recurrent as fr
    from vllm.triton_utils import tl

    fr.exp = lambda x: tl.exp(x)
    fr.log = lambda x: tl.log(x)


def _init_dist(cfg) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    path = tempfile.mktemp(prefix="dspark-k3-vllm-layers-")
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
    """Load ``path/model.safetensors`` (as float32) through the model's ``load_weights``; returns
    the parameter names it did not load."""
    from safetensors.torch import load_file

    sd = {k: v.float() for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    loaded = model.load_weights(iter(sd.items()))
    return sorted({n for n, _ in model.named_parameters()} - set(loaded))


def mla_ref_attention(attn, h, positions=None, ctx=None, mask=None):
    """vLLM's MLA layer ``attn`` on hidden ``h`` [T,H] with its own modules; the softmax is plain
    reference code. ``ctx`` = (context latents [C,kv_lora_rank], roped context k_pe [C,rope])
    prepends context keys (the drafter); ``mask`` [T, C+T] (default: causal over ``h``)."""
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


def kda(attn, h):
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


class K3VllmPair:
    """vLLM's Kimi-K3 target and DSpark drafter of a pair directory (``write_k3_pair`` layout),
    float32 on CPU. Call the forwards inside :meth:`running`."""

    def __init__(self, pair: str, num_speculative_tokens: int = 7, max_model_len: int = 1024):
        import vllm.v1.worker.cpu.shm  # noqa: F401  the CPU worker's torch.cuda stand-ins
        from vllm.config import set_current_vllm_config
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
            get_eagle3_aux_layers_from_config,
        )
        from vllm.v1.worker.gpu.spec_decode.eagle.utils import (
            maybe_share_target_embed,
            share_target_lm_head,
        )
        from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

        from dspark_dev.training.export import K3_DRAFT_DIR, K3_TARGET_DIR

        interpretable_kda_kernels()
        tdir, ddir = os.path.join(pair, K3_TARGET_DIR), os.path.join(pair, K3_DRAFT_DIR)
        self.cfg = EngineArgs(
            model=tdir,
            speculative_config={
                "method": "dspark",
                "model": ddir,
                "num_speculative_tokens": num_speculative_tokens,
            },
            dtype="float32",
            max_model_len=max_model_len,
            max_num_seqs=4,
            max_num_batched_tokens=max_model_len,
            enforce_eager=True,
            enable_prefix_caching=False,
            mamba_ssm_cache_dtype="float32",
        ).create_engine_config()
        _init_dist(self.cfg)
        from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkForCausalLM
        from vllm.models.kimi_k3.nvidia.model import KimiLinearForCausalLM

        with set_current_vllm_config(self.cfg), torch.device("cpu"):
            self.target = KimiLinearForCausalLM(vllm_config=self.cfg, prefix="")
            self.draft = K3DSparkForCausalLM(vllm_config=self.cfg, prefix="")
        self.unloaded_target = _load(self.target, tdir)
        self.unloaded_draft = _load(self.draft, ddir)
        # the speculator shares the target's embeddings and lm_head (dspark/utils.py:133-145)
        maybe_share_target_embed(self.draft, self.draft.model, self.target.model)
        share_target_lm_head(self.draft, self.target.lm_head, None)
        _repack(self.target)
        _repack(self.draft)
        self.aux_layer_ids = tuple(get_eagle3_aux_layers_from_config(self.cfg.speculative_config))
        self.block_size = num_speculative_tokens
        self.noise_token_id = get_parallel_drafting_token_id(self.draft.config)

    @contextlib.contextmanager
    def running(self):
        """no_grad, vLLM's current config and an (empty) forward context."""
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context

        with (
            torch.no_grad(),
            set_current_vllm_config(self.cfg),
            set_forward_context(None, self.cfg),
        ):
            yield

    def target_forward(
        self, ids: torch.Tensor, on_sublayer: SublayerHook | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One fresh sequence ``ids`` [T] through vLLM's target: (logits [T,V], the aux hidden
        states [T,H] of ``aux_layer_ids``, vLLM's capture rule: id ``L`` is the residual stream
        entering layer ``L``)."""
        model = self.target.model
        x = model.embed_tokens(ids)
        aux = []
        for i, layer in enumerate(model.layers):
            if i in self.aux_layer_ids:
                aux.append(x)
            h = layer.input_layernorm(x)
            is_kda = self.target.config.is_kda_layer(i)
            a = kda(layer.self_attn, h) if is_kda else mla_ref_attention(layer.self_attn, h)
            if on_sublayer is not None:
                on_sublayer(i, "kda" if is_kda else "mla_nope", h, a)
            x = x + a
            h = layer.post_attention_layernorm(x)
            f = layer.mlp(h)
            if on_sublayer is not None:
                on_sublayer(i, "moe" if layer.is_moe_layer else "dense_mlp", h, f)
            x = x + f
        if len(model.layers) in self.aux_layer_ids:
            aux.append(x)
        return self.target.compute_logits(x), aux

    def context(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """The drafter's context states [T,H] from the target's aux states."""
        return self.draft.combine_hidden_states(torch.cat(aux, -1))

    def draft_block(
        self, ctx: torch.Tensor, ids: torch.Tensor, anchor: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's block anchored at position ``anchor`` of ``ids`` [T]: queries
        ``[ids[anchor], noise * (N-1)]`` at positions ``anchor .. anchor+N-1`` attending to the
        context ``ctx[:anchor]`` and the whole block. Returns (base logits [N,V] without the
        Markov bias, final-normed hidden [N,H])."""
        vd = self.draft
        N = self.block_size
        blk = torch.full((N,), self.noise_token_id, dtype=torch.long)
        blk[0] = ids[anchor]
        qpos = torch.arange(anchor, anchor + N)
        cpos = torch.arange(anchor)
        x = vd.embed_input_ids(blk)
        n_layers = len(vd.model.layers)
        all_kv = vd.model.context_kv_proj(ctx[:anchor]).view(anchor, n_layers, -1)
        mask = torch.ones(N, anchor + N, dtype=torch.bool)
        residual = None
        for li, layer in enumerate(vd.model.layers):
            attn = layer.self_attn
            width = attn.kv_lora_rank
            kv = all_kv[:, li]
            c_kv_c = attn.kv_a_layernorm(kv[:, :width].contiguous())
            c_pe = kv[:, width:].unsqueeze(1).contiguous()
            _, c_k_pe = attn.rotary_emb.forward_native(cpos, c_pe, c_pe)
            if residual is None:
                residual, h = x, layer.input_layernorm(x)
            else:
                residual = x + residual
                h = layer.input_layernorm(residual)
            x = mla_ref_attention(
                attn, h, positions=qpos, ctx=(c_kv_c, c_k_pe.view(anchor, -1)), mask=mask
            )
            residual = x + residual
            x = layer.mlp(layer.post_attention_layernorm(residual))
        hidden = vd.model.final_norm(x + residual)
        return vd.compute_draft_logits(hidden), hidden

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """vLLM's Markov bias [A,V] for the previous tokens ``prev`` [A]."""
        return self.draft.markov_bias(self.draft.markov_embed(prev))

    def confidence_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The confidence head before its sigmoid, on hidden [N,H] and previous tokens [N]."""
        return self.draft.model.confidence_head(hidden, self.draft.markov_embed(prev))
