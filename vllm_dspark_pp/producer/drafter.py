"""The shared base of the context-KV-only DSpark drafters (every family module imports it).

A prefill-only producer never verifies drafts, but the decode instance's DSpark drafter reads the
draft's *context KV* for the prompt (pulled over the KV connector by layer name). So the producer
builds only what writes that KV, under the full drafter's layer names and KV-cache specs, loads
only those weights, and refuses everything that drafts (:class:`RefuseDrafting`).

What every family shares lives here: the top level (:class:`ContextKVDrafter`: construction,
the filtered weight load and its log line, the refusals, the platform check), the decoder layer
that only holds its attention (:class:`AttentionOnlyLayer`), the context model's refusals
(:class:`ContextPath`), the KV-cache layer's registration (:func:`register_cache_layer`), the
pick of vLLM's platform module, and the DeepSeek mtp drafters' layer, context model and top level
(:class:`MtpContextLayer`, :class:`MtpContextModel`, :class:`MtpContextDrafter`). Each family
module (:mod:`.qwen3`, :mod:`.deepseek_v4`, :mod:`.deepseek_v41`, :mod:`.kimi_k3`) defines its
classes at its top level, over these bases and vLLM's own context-KV methods, and
:mod:`.families` names its top-level class; :mod:`.load` builds that class through vLLM's own
DSpark loading path.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn
from vllm.logger import init_logger

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

logger = init_logger("vllm.dspark_pp.producer.drafter")


class ContextOnlyDrafterError(RuntimeError):
    """A context-KV-only drafter was asked to draft tokens."""


class DSparkConfigError(ValueError):
    """A DSpark speculative config that cannot work; the message names the fix (raised by the
    start checks, the generic ones in ``start_checks.py`` and the families' here)."""


def _refuse(what: str) -> ContextOnlyDrafterError:
    return ContextOnlyDrafterError(
        f"{what}: this DSpark drafter was built context-KV-only because this instance is a "
        "prefill-only KV producer (kv_role='kv_producer'); it writes the draft's context KV "
        "for the decode instance and cannot draft tokens. Serve decodes from a kv_consumer or "
        "kv_both instance (kv_both keeps the full drafter)."
    )


# --------------------------------------------------------------------------- refusals
def refusing(what: str):
    """A method that raises :class:`ContextOnlyDrafterError` naming ``what``."""

    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(what)

    refused.__doc__ = f"Refused on a context-KV-only drafter: {what}."
    return refused


class AttentionOnlyLayer(nn.Module):
    """A decoder layer whose only child is ``self_attn = attn_cls(**kwargs)`` (the layer shape
    every family's checkpoint names expect), its forward refused; a family's layer is a subclass
    that names ``attn_cls``."""

    attn_cls: ClassVar[type]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.self_attn = self.attn_cls(**kwargs)

    forward = refusing("draft decoder layer forward")


class ContextPath:
    """Mixed in before ``nn.Module`` by a family's context model, whose body takes vLLM's own
    context-KV methods from the full drafter's model class unchanged (they read only attributes
    the context model provides): the backbone's forward and token embedding, refused."""

    forward = refusing("draft backbone forward")
    embed_input_ids = refusing("draft token embedding")


class RefuseDrafting:
    """Every drafting entry point of a DSpark drafter, refused."""

    context_kv_only = True
    draft_id_to_target_id = None

    forward = refusing("draft forward")

    embed_input_ids = refusing("draft token embedding")

    compute_logits = refusing("draft logits")

    compute_draft_logits = compute_logits
    compute_draft_logits_local = compute_logits

    map_draft_to_target = refusing("draft-to-target id map")

    markov_embed = refusing("Markov head")

    markov_bias = markov_embed
    apply_markov_bias_gathered = markov_embed
    markov_step = markov_embed

    compute_confidence = refusing("confidence head")


# --------------------------------------------------------------------------- weights
def weight_filter(
    keep: re.Pattern[str],
) -> tuple[Callable[[str], bool], Callable[[Iterable[str]], list[str]]]:
    """``(is_kept(name), skipped(names))`` for a family's pattern of the checkpoint tensors its
    context-only drafter loads."""

    def is_kept(name: str) -> bool:
        return keep.match(name) is not None

    def skipped(names: Iterable[str]) -> list[str]:
        return [n for n in names if keep.match(n) is None]

    return is_kept, skipped


def hold_as_views(derived: torch.Tensor, params: Iterable[torch.Tensor]) -> None:
    """Make ``params`` views of ``derived``, the buffer vLLM built from them after loading by
    concatenating (or stacking) them in order along dimension 0, so their own storage is freed
    and the drafter holds those weights once. The contents must already be equal (checked:
    a layout that is not vLLM 0.34.0's raises instead of changing a weight); a weight reload
    then writes through the views into ``derived``, which vLLM's rebuild refills in place."""
    params = list(params)
    flat = derived.view(-1)  # fails unless contiguous
    if sum(p.numel() for p in params) != flat.numel():
        raise RuntimeError(
            f"a derived weight buffer of {flat.numel()} elements is not its parameters' "
            f"{sum(p.numel() for p in params)}: vLLM's layout is not 0.34.0's"
        )
    views, start = [], 0
    for p in params:
        view = flat[start : start + p.numel()].view(p.shape)
        if view.dtype != p.dtype or view.device != p.device or not view.equal(p.data):
            raise RuntimeError(
                "a derived weight buffer does not hold its parameters in order: vLLM's layout "
                "is not 0.34.0's"
            )
        views.append(view)
        start += p.numel()
    for p, view in zip(params, views, strict=True):  # all checked first: none or every one
        p.data = view


def held_weight_bytes(model: Any) -> int:
    """Bytes of the distinct storages that hold ``model``'s weights: its parameters and the
    tensors its modules keep as plain attributes (what vLLM derives from the weights after
    loading, e.g. a fused K/V projection), each storage counted once (a view of another
    tensor costs nothing); buffers (rotary tables, scales), storages they share and scalars
    (the attention layers' host copies of their KV scales) are left out. Empty tensors count 0,
    so call it before the KV cache is bound."""
    import torch

    def tensors(value: Any) -> Iterator[torch.Tensor]:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for v in value:
                if isinstance(v, torch.Tensor):
                    yield v

    buffers = {b.untyped_storage().data_ptr() for b in model.buffers() if b.numel()}
    held: dict[tuple[Any, int], int] = {}
    for module in model.modules():
        found = list(module.parameters(recurse=False))
        for name, value in vars(module).items():
            if not name.startswith(("_parameters", "_buffers", "_modules")):
                found.extend(tensors(value))
        for t in found:
            if t.dim() == 0 or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in buffers:
                held[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(held.values())


def is_context_kv_only(model: Any) -> bool:
    return bool(getattr(model, "context_kv_only", False))


# --------------------------------------------------------------------------- vLLM's drafters
def platform_module(registry_module: str, top_class: str) -> Any:
    """The module that holds vLLM's full drafter ``top_class`` on this platform: where
    ``registry_module``'s ``top_class`` is defined (vLLM's registry entry resolves the platform
    implementation, e.g. deepseek_v4/__init__.py)."""
    top = importlib.import_module(registry_module)
    return importlib.import_module(getattr(top, top_class).__module__)


def refuse_platform(family: str, module: Any, missing: str) -> NotImplementedError:
    return NotImplementedError(
        f"vllm-dspark-pp's context-KV-only {family} drafter needs vLLM's CUDA implementation "
        f"({missing} is missing from {module.__name__}; vLLM 0.34.0 ships a DSpark drafter for "
        "this family only on CUDA/ROCm, and the context-only build follows the CUDA one). "
        "Run this producer on NVIDIA GPUs or with kv_role='kv_both'."
    )


def register_cache_layer(layer: Any, vllm_config: VllmConfig, prefix: str) -> None:
    """Register a family's KV-cache layer under ``prefix`` in vLLM's static forward context (as
    vLLM's own attention layers do; the KV-cache planner finds it there), with no cache yet."""
    import torch

    registry = vllm_config.compilation_config.static_forward_context
    if prefix in registry:
        raise ValueError(f"Duplicate layer name: {prefix}")
    registry[prefix] = layer
    layer.kv_cache = torch.tensor([])


# --------------------------------------------------------------------------- the top level
class ContextKVDrafter(RefuseDrafting):
    """The top level of every family's context-KV-only drafter, mixed in before ``nn.Module``:
    ``class X(ContextKVDrafter, nn.Module)`` with

    * ``family``: the family's name (log lines);
    * ``model_cls``: the module that holds the context path, built as
      ``model_cls(vllm_config=..., prefix="model", **model_kwargs(vllm_config))``;
    * ``is_context_kv_weight(name)``: whether a checkpoint tensor feeds the context path;
    * ``load_context_weights(weights)``: loads those tensors, returns the parameter names loaded;
    * ``skipped_note``: what the skipped tensors are (the log line).
    """

    family: ClassVar[str]
    model_cls: ClassVar[type]
    skipped_note: ClassVar[str] = "embeddings, heads, MLPs, query/output projections"
    is_context_kv_weight: Callable[[str], bool]
    model: Any
    config: Any

    @classmethod
    def check_platform(cls) -> None:
        """Raise (naming the fix) where this platform's vLLM cannot back the class; every
        platform can unless a family says otherwise."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        from vllm.model_executor.models.utils import maybe_prefix

        super().__init__()
        spec = vllm_config.speculative_config
        assert spec is not None
        self.draft_model_config = spec.draft_model_config
        self.config = self.draft_model_config.hf_config
        self.model = self.model_cls(
            vllm_config=vllm_config,
            prefix=maybe_prefix(prefix, "model"),
            **self.model_kwargs(vllm_config),
        )

    @staticmethod
    def model_kwargs(vllm_config: VllmConfig) -> dict[str, Any]:
        """The draft layers are numbered after the target's (the full drafter's layer names)."""
        return {"start_layer_id": vllm_config.model_config.get_total_num_hidden_layers()}

    def load_context_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skipped = 0

        def context_only() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal skipped
            for name, tensor in weights:
                if self.is_context_kv_weight(name):
                    yield name, tensor
                else:
                    skipped += 1

        loaded = self.load_context_weights(context_only())
        logger.info(
            "Context-KV-only %s drafter: loaded %d parameters, skipped %d checkpoint tensors (%s).",
            self.family,
            len(loaded),
            skipped,
            self.skipped_note,
        )
        return loaded


# --------------------------------------------------------------------------- DeepSeek mtp drafters
# DeepSeek-V4 and V4.1 ship the drafter inside the target checkpoint as ``mtp.<i>.*`` and share
# its context path (vLLM 0.34.0: deepseek_v4/nvidia/dspark.py, deepseek_v41/nvidia/dspark.py):
# ``main_proj`` + ``main_norm`` over the concatenated taps, every layer's ``wkv`` stacked into
# ``context_wkv_proj``, then each layer's ``kv_norm``, RoPE and insert. The families differ in
# the attention layer they hold (:mod:`.deepseek_v4`, :mod:`.deepseek_v41`).
MTP_CONTEXT_KEEP = re.compile(
    r"^(?:mtp\.\d+\.(?:main_proj|main_norm)\.|"
    r"mtp\.\d+\.attn\.(?:wkv|kv_norm)\.|"
    r"context_wkv_proj\.)"
)

#: Whether a DeepSeek checkpoint tensor feeds the context-only drafter; the rest.
is_mtp_context_weight, mtp_skipped_weight_names = weight_filter(MTP_CONTEXT_KEEP)


def mtp_context_param_name(name: str, n_layers: int) -> tuple[str | None, int | None]:
    """Checkpoint name -> (context-only parameter, shard of context_wkv_proj or None), the
    names vLLM's ``_remap_dspark_name`` gives them."""
    if name.endswith(".scale"):  # block-fp8 linear scales (the full loader's ``.scale`` rename)
        name = name.removesuffix(".scale") + ".weight_scale_inv"
    if name.startswith("context_wkv_proj."):
        return "model." + name, None
    m = re.match(r"mtp\.(\d+)\.(.*)$", name)
    assert m is not None
    stage, rest = int(m.group(1)), m.group(2)
    if rest.startswith(("main_proj.", "main_norm.")):
        return "model." + rest, None
    if rest.startswith("attn.kv_norm."):
        return f"model.layers.{stage}.{rest}", None
    if rest.startswith("attn.wkv."):
        if stage >= n_layers:
            return None, None
        return "model.context_wkv_proj." + rest.removeprefix("attn.wkv."), stage
    return None, None


def build_mtp_context_model(
    model: Any, vllm_config: VllmConfig, prefix: str, n_layers: int, make_layer: Callable
) -> None:
    """Give ``model`` (an ``nn.Module`` under construction) the context path of a DeepSeek mtp
    drafter: ``main_proj``, ``main_norm``, ``n_layers`` layers ``make_layer(vllm_config,
    prefix)`` numbered after the target's, and ``context_wkv_proj``, as vLLM builds them."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
    from vllm.model_executor.models.utils import maybe_prefix

    spec = vllm_config.speculative_config
    assert spec is not None
    config = spec.draft_model_config.hf_config
    model.config = config
    model.hidden_size = config.hidden_size
    model.num_hidden_layers = config.num_hidden_layers
    model.target_layer_ids = tuple(config.dspark_target_layer_ids)
    model.num_dspark_layers = n_layers
    linear: dict[str, Any] = {
        "bias": False,
        "return_bias": False,
        "quant_config": vllm_config.quant_config,
    }
    model.main_proj = ReplicatedLinear(
        config.hidden_size * len(model.target_layer_ids),
        config.hidden_size,
        prefix=maybe_prefix(prefix, "main_proj"),
        **linear,
    )
    model.main_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    current = get_current_vllm_config()
    model.layers = nn.ModuleList(
        make_layer(current, maybe_prefix(prefix, f"layers.{model.num_hidden_layers + i}"))
        for i in range(n_layers)
    )
    model.context_wkv_proj = MergedColumnParallelLinear(
        config.hidden_size,
        [config.head_dim] * n_layers,
        prefix=maybe_prefix(prefix, "context_wkv_proj"),
        disable_tp=True,
        **linear,
    )
    model.confidence_head = None


def _mtp_missing(dspark: Any) -> tuple[Any, str] | None:
    """(module, name) of what a platform's DeepSeek mtp drafter module lacks for the context-only
    build (its model class, or the model module's ``_select_dsv4_attn_cls``); None: nothing."""
    if getattr(dspark, "DSparkDeepseekV4Model", None) is None:
        return dspark, "DSparkDeepseekV4Model"
    model_module = sys.modules[dspark.DeepseekV4DecoderLayer.__module__]
    if getattr(model_module, "_select_dsv4_attn_cls", None) is None:
        return model_module, "_select_dsv4_attn_cls"
    return None


def _mtp_pick(registry_module: str) -> Any:
    return platform_module(registry_module, "DSparkDeepseekV4ForCausalLM")


def mtp_vllm_module(registry_module: str, cuda_module: str) -> Any:
    """The module of vLLM's DeepSeek mtp drafter a family's classes borrow from: this platform's
    (``registry_module``'s pick: ``vllm.models.deepseek_v4`` or ``..._v41``) where it has the
    drafter, else the CUDA one (``cuda_module``; on the CPU platform, whose module is a stub, the
    classes are defined all the same and :func:`check_mtp_platform` refuses to serve them)."""
    pick = _mtp_pick(registry_module)
    return pick if _mtp_missing(pick) is None else importlib.import_module(cuda_module)


def mtp_select_attn_cls(dspark: Any) -> Any:
    """``_select_dsv4_attn_cls`` of the model module behind a DeepSeek mtp drafter module."""
    return sys.modules[dspark.DeepseekV4DecoderLayer.__module__]._select_dsv4_attn_cls


def check_mtp_platform(family: str, registry_module: str) -> None:
    """Refuse (:func:`refuse_platform`) where this platform's pick of vLLM's DeepSeek mtp drafter
    cannot back the context-only build."""
    missing = _mtp_missing(_mtp_pick(registry_module))
    if missing is not None:
        raise refuse_platform(family, *missing)


def register_fp8_scales(layer: Any) -> None:
    """The per-tensor FP8 insert reads these scales (FlashInfer attention classes set them to 1):
    non-persistent buffers of ``layer``."""
    import torch

    for name in ("_flashinfer_fp8_q_scale", "_flashinfer_fp8_q_scale_inv",
                 "_flashinfer_fp8_kv_scale"):  # fmt: skip
        layer.register_buffer(name, torch.ones(1, dtype=torch.float32), persistent=False)


def set_mtp_attention_geometry(
    layer: Any, config: Any, full_cls: Any, compress_ratio: int, build_rope: Any
) -> None:
    """The head, window and rotary attributes the context-KV insert reads of a DeepSeek mtp draft
    layer's attention, as the class vLLM selects (``full_cls``) sets them at this TP size: heads,
    padded query heads, head and rope dims, window, eps and scale, the ``kv_norm`` weights and the
    rotary table built by the family's ``build_rope`` at ``compress_ratio``."""
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.layernorm import RMSNorm

    layer.compress_ratio = compress_ratio
    layer.n_heads = config.num_attention_heads
    layer.n_local_heads = layer.n_heads // get_tensor_model_parallel_world_size()
    layer.head_dim = config.head_dim
    layer.rope_head_dim = config.qk_rope_head_dim
    layer.window_size = config.sliding_window
    layer.eps = config.rms_norm_eps
    layer.scale = layer.head_dim**-0.5
    layer.padded_heads = full_cls.get_padded_num_q_heads(layer.n_local_heads)
    layer.kv_norm = RMSNorm(layer.head_dim, layer.eps)
    layer.rotary_emb = build_rope(
        config,
        head_dim=layer.head_dim,
        rope_head_dim=layer.rope_head_dim,
        max_position_embeddings=config.max_position_embeddings,
        compress_ratio=compress_ratio,
    )


class MtpContextLayer(nn.Module):
    """A DeepSeek mtp draft layer holding only ``attn = attn_cls(vllm_config, prefix)``; a
    family's layer is a subclass that names ``attn_cls``."""

    attn_cls: ClassVar[type]

    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.attn = self.attn_cls(vllm_config, prefix=f"{prefix}.attn")

    forward = refusing("draft decoder layer forward")


class MtpContextModel(ContextPath, nn.Module):
    """main_proj/main_norm + context_wkv_proj + per-layer kv_norm/rope/SWA cache
    (:func:`build_mtp_context_model`). A family's model is a subclass that names ``layer_cls``
    and ``n_layers`` (the draft layer count of its hf config) and takes vLLM's own
    ``combine_hidden_states`` and ``precompute_and_store_context_kv`` of the full drafter's
    model class."""

    layer_cls: ClassVar[type]

    @staticmethod
    def n_layers(config: Any) -> int:
        raise NotImplementedError

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        spec = vllm_config.speculative_config
        assert spec is not None
        count = self.n_layers(spec.draft_model_config.hf_config)
        build_mtp_context_model(self, vllm_config, prefix, count, self.layer_cls)


class MtpContextDrafter(ContextKVDrafter, nn.Module):
    """The top level of a DeepSeek mtp family's context-KV-only drafter. A family's top level is
    a subclass that names ``family`` and ``model_cls`` and takes vLLM's own
    ``combine_hidden_states``, ``get_draft_kv_cache_layer_names`` and
    ``precompute_and_store_context_kv`` of the full drafter's top-level class."""

    is_context_kv_weight = staticmethod(is_mtp_context_weight)
    skipped_note = "embeddings, heads, MoE, query/output projections, hyper-connections"

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.quant_config = vllm_config.quant_config

    @staticmethod
    def model_kwargs(vllm_config: VllmConfig) -> dict[str, Any]:
        return {}  # numbered from the draft config's num_hidden_layers (the target's own)

    def load_context_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
        return load_mtp_context_weights(self, weights)


def load_mtp_context_weights(model: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
    """main_proj/main_norm, kv_norm and each layer's wkv (into context_wkv_proj, shard = layer)
    from the target checkpoint's ``mtp.*``; returns the parameters loaded."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        target, shard = mtp_context_param_name(name, len(model.model.layers))
        if target is None:
            continue
        param = params[target]
        if shard is not None:
            param.weight_loader(param, tensor, shard)
        else:
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        loaded.add(target)
    return loaded


# --------------------------------------------------------------------------- start checks
#: Model types whose DSpark drafter ships inside the target checkpoint (DeepSeek-V4, V4.1).
IN_TARGET_MODEL_TYPES = ("deepseek_v4", "deepseek_v41")


def check_target_carries_the_draft(vllm_config: Any) -> None:
    """Start check of the families whose drafter lives inside a DeepSeek-V4 checkpoint: their
    target must be one. vLLM 0.34.0 (``dspark/config.py`` ``adapt_draft_model_config``) takes any
    draft it does not recognize as a self-contained DSpark checkpoint for a DeepSeek-V4 target's
    built-in drafter and relabels it ``DSparkDraftModel`` / deepseek_v4, whatever it really is:
    this check is what refuses such a draft at start."""
    spec = vllm_config.speculative_config
    draft, target = spec.draft_model_config, spec.target_model_config
    draft_type = getattr(draft.hf_config, "model_type", None)
    target_type = getattr(getattr(target, "hf_config", None), "model_type", None)
    if draft_type not in IN_TARGET_MODEL_TYPES or target_type in IN_TARGET_MODEL_TYPES:
        return
    raise DSparkConfigError(
        f"--speculative-config method 'dspark': the draft model {draft.model!r} is not a "
        "self-contained DSpark drafter (vLLM recognizes one by 'dspark' in its path and a DSpark "
        "architecture in its config.json, e.g. deepseek-ai/dspark_qwen3_8b_block7), and only "
        "DeepSeek-V4 targets carry their DSpark drafter inside the target checkpoint; this "
        f"target is {target_type!r}. Point 'model' at a DSpark draft checkpoint for this "
        "target, or use the method that matches this draft (e.g. 'dflash', 'eagle3', "
        "'draft_model')."
    )
