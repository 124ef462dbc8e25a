"""The shared base of the context-KV-only DSpark drafters (every family module imports it).

A prefill-only producer never verifies drafts, but the decode instance's DSpark drafter reads the
draft's *context KV* for the prompt (pulled over the KV connector by layer name). So the producer
builds only what writes that KV, under the full drafter's layer names and KV-cache specs, loads
only those weights, and refuses everything that drafts (:class:`RefuseDrafting`).

What every family shares lives here: the top level (:class:`ContextKVDrafter`: construction,
the filtered weight load and its log line, the refusals), the decoder layer that only holds its
attention (:func:`layer_holding`), the KV-cache layer's registration (:func:`register_cache_layer`),
the once-per-process class cache (:func:`built_once`) and the pick of vLLM's platform module.
Each family module (:mod:`.qwen3`, :mod:`.deepseek_v4`, :mod:`.kimi_k3`) defines only what its
context path needs and registers itself in :mod:`.families`; :mod:`.load` builds the class the
registry names through vLLM's own DSpark loading path.
"""

from __future__ import annotations

import functools
import importlib
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.logger import init_logger

from vllm_dspark_pp.producer.families import DSparkConfigError

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

logger = init_logger("vllm.dspark_pp.producer.drafter")


class ContextOnlyDrafterError(RuntimeError):
    """A context-KV-only drafter was asked to draft tokens."""


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


def layer_holding(attn_cls: type, name: str) -> type:
    """A decoder-layer module named ``name`` whose only child is ``self_attn = attn_cls(**kwargs)``
    (the layer shape every family's checkpoint names expect) and whose forward is refused."""
    from torch import nn

    def __init__(self: Any, **kwargs: Any) -> None:
        nn.Module.__init__(self)
        self.self_attn = attn_cls(**kwargs)

    return type(
        name,
        (nn.Module,),
        {"__init__": __init__, "forward": refusing("draft decoder layer forward")},
    )


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
def platform_module(registry_module: str, top_class: str, module_name: str | None) -> Any:
    """The module that holds vLLM's full drafter ``top_class`` on this platform: ``module_name``
    when given, else where ``registry_module``'s ``top_class`` is defined (vLLM's registry entry
    resolves the platform implementation, e.g. deepseek_v4/__init__.py)."""
    if module_name is None:
        top = importlib.import_module(registry_module)
        module_name = getattr(top, top_class).__module__
    return importlib.import_module(module_name)


def refuse_platform(family: str, module: Any, missing: str) -> NotImplementedError:
    return NotImplementedError(
        f"vllm-dspark-pp's context-KV-only {family} drafter needs vLLM's CUDA implementation "
        f"({missing} is missing from {module.__name__}; vLLM 0.34.0 ships a DSpark drafter for "
        "this family only on CUDA/ROCm, and the context-only build follows the CUDA one). "
        "Run this producer on NVIDIA GPUs or with kv_role='kv_both'."
    )


def context_path(base: type, *names: str) -> Any:
    """The base of a family's context model: vLLM's own context-KV methods ``names`` of ``base``
    (the full drafter's model class), used unchanged because they read only attributes the
    context model provides, with the backbone's forward and token embedding refused.
    ``class M(context_path(base, ...), nn.Module)``."""
    body: dict[str, Any] = {name: getattr(base, name) for name in names}
    body["forward"] = refusing("draft backbone forward")
    body["embed_input_ids"] = refusing("draft token embedding")
    return type(f"{base.__name__}ContextPath", (), body)


def register_cache_layer(layer: Any, vllm_config: VllmConfig, prefix: str) -> None:
    """Register a family's KV-cache layer under ``prefix`` in vLLM's static forward context (as
    vLLM's own attention layers do; the KV-cache planner finds it there), with no cache yet."""
    import torch

    registry = vllm_config.compilation_config.static_forward_context
    if prefix in registry:
        raise ValueError(f"Duplicate layer name: {prefix}")
    registry[prefix] = layer
    layer.kv_cache = torch.tensor([])


def built_once(build: Callable[[str | None], type]) -> Callable[[str | None], type]:
    """``build(module_name)`` defines a family's classes against vLLM's drafter module
    (``None``: the family's default); the function returned builds them once per process and
    module, so every caller gets the same class."""
    cache: dict[str | None, type] = {}
    lock = threading.Lock()

    @functools.wraps(build)
    def get(module_name: str | None = None) -> type:
        with lock:
            if module_name not in cache:
                cache[module_name] = build(module_name)
            return cache[module_name]

    return get


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
    from torch import nn
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


def mtp_platform(family: str, registry_module: str, module_name: str | None) -> tuple[Any, ...]:
    """vLLM's DeepSeek mtp drafter on this platform (``registry_module``: ``vllm.models.
    deepseek_v4`` or ``..._v41``; ``module_name``: as :func:`platform_module`): its model class,
    its top-level class and the model module's ``_select_dsv4_attn_cls``; refused where the
    platform's module lacks them (:func:`refuse_platform`)."""
    import sys

    dspark = platform_module(registry_module, "DSparkDeepseekV4ForCausalLM", module_name)
    base_model: Any = getattr(dspark, "DSparkDeepseekV4Model", None)
    if base_model is None:
        raise refuse_platform(family, dspark, "DSparkDeepseekV4Model")
    base_top = dspark.DSparkDeepseekV4ForCausalLM
    model_module = sys.modules[dspark.DeepseekV4DecoderLayer.__module__]
    select_attn_cls: Any = getattr(model_module, "_select_dsv4_attn_cls", None)
    if select_attn_cls is None:
        raise refuse_platform(family, model_module, "_select_dsv4_attn_cls")
    return base_model, base_top, select_attn_cls


def register_fp8_scales(layer: Any) -> None:
    """The per-tensor FP8 insert reads these scales (FlashInfer attention classes set them to 1):
    non-persistent buffers of ``layer``."""
    import torch

    for name in ("_flashinfer_fp8_q_scale", "_flashinfer_fp8_q_scale_inv",
                 "_flashinfer_fp8_kv_scale"):  # fmt: skip
        layer.register_buffer(name, torch.ones(1, dtype=torch.float32), persistent=False)


def mtp_context_drafter(
    family: str,
    name: str,
    base: tuple[Any, ...],
    attn_cls: type,
    n_layers: Callable[[Any], int],
) -> type:
    """The top level of a DeepSeek mtp family's context-KV-only drafter: decoder layers holding
    only ``attn = attn_cls(vllm_config, prefix)``, the context model (vLLM's own context-KV
    methods of ``base``'s model class, :func:`build_mtp_context_model` with ``n_layers(draft hf
    config)`` layers) and the top level with vLLM's own top-level methods (``base``: what
    :func:`mtp_platform` returned). Classes named ``<name>ContextKVLayer`` / ``...Model`` /
    ``...ForCausalLM``."""
    from torch import nn

    base_model, base_top, _ = base

    def named(cls: type, suffix: str) -> type:
        cls.__name__ = cls.__qualname__ = f"{name}ContextKV{suffix}"
        return cls

    class Layer(nn.Module):
        def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
            super().__init__()
            self.attn = attn_cls(vllm_config, prefix=f"{prefix}.attn")

        forward = refusing("draft decoder layer forward")

    named(Layer, "Layer")
    # vLLM 0.34.0's context-KV code, unchanged (deepseek_v4*/nvidia/dspark.py).
    path: Any = context_path(base_model, "combine_hidden_states", "precompute_and_store_context_kv")

    class Model(path, nn.Module):
        """main_proj/main_norm + context_wkv_proj + per-layer kv_norm/rope/SWA cache."""

        def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
            super().__init__()
            spec = vllm_config.speculative_config
            assert spec is not None
            count = n_layers(spec.draft_model_config.hf_config)
            build_mtp_context_model(self, vllm_config, prefix, count, Layer)

    named(Model, "Model")

    class Top(ContextKVDrafter, nn.Module):
        model_cls = Model
        is_context_kv_weight = staticmethod(is_mtp_context_weight)
        skipped_note = "embeddings, heads, MoE, query/output projections, hyper-connections"

        def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self.quant_config = vllm_config.quant_config

        @staticmethod
        def model_kwargs(vllm_config: VllmConfig) -> dict[str, Any]:
            return {}  # numbered from the draft config's num_hidden_layers (the target's own)

        combine_hidden_states = base_top.combine_hidden_states
        get_draft_kv_cache_layer_names = base_top.get_draft_kv_cache_layer_names
        precompute_and_store_context_kv = base_top.precompute_and_store_context_kv

        def load_context_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
            return load_mtp_context_weights(self, weights)

    Top.family = family
    Top.__doc__ = f"Top level of the {family} context-KV-only drafter."
    return named(Top, "ForCausalLM")


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
