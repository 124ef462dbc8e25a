"""The deployment plan: what vLLM 0.34.0 plus this plugin would do with a configuration.

Built from config.json files only (no weights, no GPU) through vLLM's own ``EngineArgs`` and
``VllmConfig``, so every validation vLLM runs at start-up runs here too. Pure functions of the
resulting config compute the per-stage layout over TP x PP (each stage's layers, its global ranks,
the target weight bytes one TP rank of it holds, and on the drafting stage the drafter bytes one TP
rank holds); :mod:`vllm_dspark_pp.cli.plan` prints it. At PP > 1 with a DSpark draft the plan also
prices each stage with :mod:`vllm_dspark_pp.stage_balance`'s cost model and recommends a
``VLLM_PP_LAYER_PARTITION`` that offloads layers from the drafting stage (an estimate).

Per-rank bytes. Target weights: from the tensor sizes in the target folder's ``*.safetensors``
headers (only the headers are read; a folder with config.json alone gets no figure), each tensor
on the stage vLLM builds it on and divided by TP where vLLM shards it (:func:`tp_share`: a
rule by tensor name, an estimate for architectures with their own layouts). Drafter: the draft
family's memory rule, split per rank by which of its parts vLLM shards
(:func:`qwen3_draft_bytes_per_rank`).

On a machine without a GPU vLLM's platform detection picks no CUDA platform. The supported way
around it is vLLM's own device override ``VLLM_TARGET_DEVICE=cpu`` (its CPU platform), which the
CLI sets for its own process only. The CPU platform rewrites a few settings (it turns async
scheduling and CUDA graphs off, may change the dtype, turns prefix caching off for MLA targets on
CPUs without AMX) and cannot run GPU-only checks; the plan lists those under ``not_checked``
instead of passing them silently.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from vllm_dspark_pp.stage_balance import (
    CostModelError,
    StageBalance,
    format_stage_balance,
    partition_ranges,
    stage_balance,
)


@dataclass
class Stage:
    rank: int
    layers: tuple[int, int]  # [start, end)
    aux_taps: list[int]  # tap ids produced on this stage
    drafts: bool
    relay_out_taps: list[int]  # tap ids carried to the next stage
    relay_bytes_per_token: int  # aux-tap bytes per token sent to the next stage
    # ... with VLLM_DSPARK_PP_TAP_PARTIALS=auto (one partial row where >= 2 taps would cross)
    partial_relay_bytes_per_token: int = 0
    global_ranks: list[int] = field(default_factory=list)  # its TP ranks (DP rank 0)
    weight_bytes_per_rank: int | None = None  # target weights one TP rank of it holds
    draft_bytes_per_rank: int | None = None  # the drafter one TP rank holds (this role's)


@dataclass
class Plan:
    target: str
    target_architecture: str
    num_layers: int
    pp_size: int
    tp_size: int
    method: str | None
    num_speculative_tokens: int | None
    draft: str | None
    draft_architecture: str | None
    draft_pp_size: int | None
    aux_tap_ids: list[int]
    stages: list[Stage]
    kv_role: str | None
    platform: str
    dtype: str = ""  # the weights' dtype vLLM picked (sizes the per-rank bytes)
    accepted: bool = True
    messages: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    # the stage costs and the recommended VLLM_PP_LAYER_PARTITION (PP > 1 with a DSpark draft)
    layer_partition: StageBalance | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)


def pp_layer_ranges(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Each PP rank's [start, end) layers, as vLLM assigns them (VLLM_PP_LAYER_PARTITION aware)."""
    from vllm.distributed.utils import get_pp_indices

    return [get_pp_indices(num_layers, rank, pp_size) for rank in range(pp_size)]


def tap_stage(tap_id: int, ranges: list[tuple[int, int]]) -> int:
    """The PP rank that produces aux tap ``tap_id``.

    vLLM's decoder (e.g. ``Qwen2Model.forward``) records tap ``L`` right after running layer
    ``L - 1`` (tap 0 is the embedding output, on the first rank).
    """
    if tap_id == 0:
        return 0
    for rank, (start, end) in enumerate(ranges):
        if start <= tap_id - 1 < end:
            return rank
    raise ValueError(f"aux tap {tap_id} refers to no target layer (layers 0..{ranges[-1][1] - 1})")


def build_plan_stages(
    num_layers: int,
    pp_size: int,
    tap_ids: list[int],
    hidden_size: int,
    dtype_bytes: int,
    partial_width: int | None = None,
) -> list[Stage]:
    """The stages of an even layer split, the taps each makes and the aux bytes per token each
    sends on: raw taps (vLLM's relay) and, where ``VLLM_DSPARK_PP_TAP_PARTIALS=auto`` would switch
    the relay on (some boundary carrying two or more taps), one partial row of ``partial_width``
    (the drafter's hidden size; default the target's) at every boundary that carries a tap."""
    partial_row = (partial_width or hidden_size) * dtype_bytes
    ranges = pp_layer_ranges(num_layers, pp_size)
    produced: dict[int, list[int]] = {r: [] for r in range(pp_size)}
    for tap in tap_ids:
        produced[tap_stage(tap, ranges)].append(tap)
    stages = []
    carried: list[int] = []
    for rank, rng in enumerate(ranges):
        carried = carried + produced[rank]
        last = rank == pp_size - 1
        out = [] if last else list(carried)
        stages.append(
            Stage(
                rank=rank,
                layers=rng,
                aux_taps=produced[rank],
                drafts=last,
                relay_out_taps=out,
                relay_bytes_per_token=len(out) * hidden_size * dtype_bytes,
                partial_relay_bytes_per_token=partial_row if out else 0,
            )
        )
    if max((len(st.relay_out_taps) for st in stages), default=0) < 2:  # auto leaves it off
        for st in stages:
            st.partial_relay_bytes_per_token = st.relay_bytes_per_token
    return stages


def stage_global_ranks(pp_size: int, tp_size: int) -> list[list[int]]:
    """Each PP stage's global ranks (its TP ranks), in vLLM's layout (TP fastest; DP rank 0)."""
    from vllm_dspark_pp.protocol.world import WorldShape

    shape = WorldShape(world_size=pp_size * tp_size, tp=tp_size, pp=pp_size)
    return [[g for g in range(shape.world_size) if shape.coords(g).pp == p] for p in range(pp_size)]


# safetensors dtype -> bytes per element as stored
_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip
_ST_FLOAT = ("F64", "F32", "F16", "BF16")  # loaded in the model's dtype


def checkpoint_tensors(folder: str) -> dict[str, tuple[str, list[int]]]:
    """``{name: (dtype, shape)}`` of every tensor in ``folder``'s ``*.safetensors`` files, read
    from their headers only (8-byte length, then a JSON table); empty when there are none."""
    import glob
    import os
    import struct

    out: dict[str, tuple[str, list[int]]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error):
            continue  # unreadable: sized as if absent
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (info["dtype"], list(info["shape"]))
    return out


# vLLM's MLA keeps its low-rank down-projections whole on every TP rank (ReplicatedLinear).
_REPLICATED_LINEARS = ("q_a_proj", "kv_a_proj_with_mqa")


def tp_share(name: str, ndim: int, tp: int, num_kv_heads: int) -> float:
    """The fraction of tensor ``name`` one of ``tp`` ranks holds in vLLM: vectors (norms,
    biases, sinks) and routers whole; K/V projections split over the KV heads (a rank holds
    ``max(1, heads // tp)`` of them: replicated when there are fewer heads than ranks); MLA's
    low-rank down-projections whole; every other matrix (attention, MLP, experts, the
    vocab-parallel embedding and LM head) divided by ``tp``."""
    if tp <= 1:
        return 1.0
    if ndim <= 1 or "norm" in name or name.endswith(".gate.weight"):
        return 1.0
    if any(f".{r}." in name for r in _REPLICATED_LINEARS):
        return 1.0
    if ".k_proj." in name or ".v_proj." in name:
        return max(1, num_kv_heads // tp) / num_kv_heads
    return 1.0 / tp


def stage_weight_bytes(
    tensors: dict[str, tuple[str, list[int]]],
    ranges: list[tuple[int, int]],
    tp: int,
    num_kv_heads: int,
    dtype_bytes: int,
    tied_embeddings: bool = False,
) -> list[int]:
    """Target weight bytes one TP rank of each stage holds. A tensor of layer ``L``
    (``layers.L.``) lives on the stage running L; the embedding on the first stage; everything
    else outside the layers (final norm, LM head, a drafter shipped in the target checkpoint) on
    the last. With tied embeddings and PP > 1 the last stage builds its own copy of the
    embedding as LM head (vLLM's Qwen2/Qwen3/Llama models do)."""
    import math
    import re

    per_stage = [0.0] * len(ranges)
    last = len(ranges) - 1
    embed = 0.0
    has_head = False
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * (dtype_bytes if dtype in _ST_FLOAT else _ST_BYTES.get(dtype, 1))
        held = size * tp_share(name, len(shape), tp, num_kv_heads)
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if m and int(m.group(1)) < ranges[-1][1]:
            layer = int(m.group(1))
            stage = next(r for r, (a, b) in enumerate(ranges) if a <= layer < b)
        elif "embed" in name and not m:
            stage, embed = 0, embed + held
        else:
            stage = last
            has_head |= "lm_head" in name or name.startswith("head.")
        per_stage[stage] += held
    if tied_embeddings and not has_head and last > 0:
        per_stage[last] += embed
    return [int(b) for b in per_stage]


def qwen3_draft_bytes_per_rank(
    hf: Any, dtype_bytes: int, own_embed: bool, own_head: bool, tp: int
) -> dict[str, int]:
    """A Qwen3 DSpark drafter's bytes on one of ``tp`` ranks (vLLM builds it with the target's
    TP): its attention and MLP are tensor-parallel, its embedding, LM head and Markov
    projection vocab-parallel; ``fc`` (a ``ReplicatedLinear``), the norms, the mask embedding,
    the Markov token table and the draft-to-target map are whole on every rank. The fused K/V
    copy of the full drafter holds this rank's K/V rows. At TP=1 equal to the family's
    ``draft_load_bytes``."""
    from vllm_dspark_pp.producer.memory import _get, draft_param_bytes

    comp = draft_param_bytes(hf, role="kv_both", dtype_bytes=dtype_bytes)["components"]
    nq = int(_get(hf, "num_attention_heads"))
    nkv = int(_get(hf, "num_key_value_heads", nq))
    vocab = int(_get(hf, "vocab_size"))
    dvocab = int(_get(hf, "draft_vocab_size", None) or vocab)
    kv = max(1, nkv // tp) / nkv
    share = {
        "embed_tokens": 1 / tp if own_embed else 0.0,
        "lm_head": 1 / tp if own_head else 0.0,
        "layers.q_proj": 1 / tp,
        "layers.o_proj": 1 / tp,
        "layers.mlp": 1 / tp,
        "layers.kv_proj": kv,
        "markov_head": (vocab + dvocab / tp) / (vocab + dvocab),  # w1 whole, w2 vocab-parallel
    }
    fused_copy = comp["layers.kv_proj"] * kv + comp["layers.k_norm"]
    full = sum(v * share.get(k, 1.0) for k, v in comp.items()) + fused_copy
    context_only = comp["fc"] + comp["hidden_norm"] + fused_copy
    return {"full": int(full), "context_only": int(context_only)}


#: Per-rank drafter rules by draft family name (families without one get no per-rank figure).
DRAFT_BYTES_PER_RANK = {"Qwen3 DSpark": qwen3_draft_bytes_per_rank}


# Checks this plugin adds to vLLM's own validation. Each takes the VllmConfig and returns a list of
# error messages (empty when the configuration passes). Feature modules append theirs.
PluginCheck = Callable[[Any], list[str]]
PLUGIN_CHECKS: list[PluginCheck] = []


def _check_stages_nonempty(vllm_config) -> list[str]:
    pc = vllm_config.parallel_config
    n = vllm_config.model_config.get_total_num_hidden_layers()
    empty = [r for r, (s, e) in enumerate(pp_layer_ranges(n, pc.pipeline_parallel_size)) if e <= s]
    if empty:
        return [
            f"pipeline-parallel size {pc.pipeline_parallel_size} leaves PP ranks {empty} without "
            f"target layers ({n} layers): use -pp <= {n} or set VLLM_PP_LAYER_PARTITION"
        ]
    return []


PLUGIN_CHECKS.append(_check_stages_nonempty)


def _gpu_only_checks(vllm_config, requested_async: bool | None) -> list[str]:
    """What the CPU platform cannot check or silently rewrites."""
    notes = [
        "CUDA graph capture (sizes, padding, the DSpark draft graphs): the CPU platform disables "
        "CUDA graphs",
        "attention-backend selection for the target and the draft's non-causal block attention",
        "KV-cache memory fit (gpu_memory_utilization) and NCCL group creation for PP/TP",
    ]
    sched = vllm_config.scheduler_config
    if requested_async is not False and not sched.async_scheduling:
        notes.append(
            "scheduling mode: the CPU platform forces synchronous scheduling; a GPU deployment "
            "defaults to async scheduling (both modes are supported by this plugin)"
        )
    return notes


def make_plan(
    target: str,
    speculative_config: dict | None = None,
    pipeline_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    kv_transfer_config: dict | None = None,
    extra_engine_args: dict | None = None,
    draft_cost_layers: float | None = None,
) -> Plan:
    """Build vLLM's config for this deployment and describe it. Raises on vLLM's own rejection.

    ``draft_cost_layers``: the drafter's measured cost in target layers, for the stage balance
    (replaces the cost model's figure for the drafter)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    requested_async = (extra_engine_args or {}).get("async_scheduling")
    args = EngineArgs(
        model=target,
        skip_tokenizer_init=True,
        load_format="dummy",
        pipeline_parallel_size=pipeline_parallel_size,
        tensor_parallel_size=tensor_parallel_size,
        speculative_config=dict(speculative_config) if speculative_config else None,
        kv_transfer_config=kv_transfer_config,  # type: ignore[arg-type]  # EngineArgs parses it
        **(extra_engine_args or {}),
    )
    cpu_rewrote_prefix_caching = False
    try:
        vllm_config = args.create_engine_config()
    except Exception as exc:
        if current_platform.device_name != "cpu" or CPU_MLA_PREFIX_CACHING_REFUSAL not in str(exc):
            raise
        # The CPU platform's own rewrite, not the deployment's fault: see CPU_MLA_PREFIX_CACHING.
        args = replace(args, enable_prefix_caching=False)
        vllm_config = args.create_engine_config()
        cpu_rewrote_prefix_caching = True
    plan = describe(
        vllm_config, target, requested_async, current_platform.device_name, draft_cost_layers
    )
    if cpu_rewrote_prefix_caching:
        plan.not_checked.append(CPU_MLA_PREFIX_CACHING)
    return plan


# vLLM 0.34.0's CPU platform turns prefix caching (and chunked prefill) off for an MLA target on a
# CPU without AMX tiles (vllm/platforms/cpu.py:268-289 and 532-546: its reference MLA kernel has
# neither). For a hybrid MLA target (Kimi-K3: KDA + MLA) the hybrid-model hook has already set the
# mamba block size for prefix caching (model_executor/models/config.py:1094-1110), so vLLM refuses
# the config (config/vllm.py:3583-3594) on such CPUs (AMD EPYC, for one) while a GPU deployment,
# or an AMX CPU, accepts it (issue 24). The plan is then built with prefix caching off and says so.
CPU_MLA_PREFIX_CACHING_REFUSAL = "--mamba-block-size can only be set with --enable-prefix-caching"
CPU_MLA_PREFIX_CACHING = (
    "prefix caching: vLLM's CPU platform turns it off for MLA targets on CPUs without AMX, which "
    "this hybrid target's mamba block size does not allow; planned with prefix caching off (a GPU "
    "deployment keeps it on)"
)


def describe(
    vllm_config,
    target: str,
    requested_async=None,
    platform: str = "?",
    draft_cost_layers: float | None = None,
) -> Plan:
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    spec = vllm_config.speculative_config
    n_layers = mc.get_total_num_hidden_layers()
    taps: list[int] = []
    draft = draft_arch = None
    draft_pp = None
    if spec is not None and spec.draft_model_config is not None:
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
            get_eagle3_aux_layers_from_config,
        )

        taps = sorted(get_eagle3_aux_layers_from_config(spec) or ())
        draft = spec.draft_model_config.model
        draft_arch = spec.draft_model_config.architectures[0]
        draft_pc = getattr(spec, "draft_parallel_config", None)
        draft_pp = draft_pc.pipeline_parallel_size if draft_pc is not None else None
    dtype_bytes = mc.dtype.itemsize if hasattr(mc.dtype, "itemsize") else 2
    draft_hidden = None
    if spec is not None and spec.draft_model_config is not None:
        draft_hidden = spec.draft_model_config.get_hidden_size()
    stages = build_plan_stages(
        n_layers, pc.pipeline_parallel_size, taps, mc.get_hidden_size(), dtype_bytes, draft_hidden
    )
    tp = pc.tensor_parallel_size
    for stage, ranks in zip(stages, stage_global_ranks(pc.pipeline_parallel_size, tp), strict=True):
        stage.global_ranks = ranks
    hf_text = mc.hf_text_config
    tensors = checkpoint_tensors(mc.model)
    nq = int(getattr(hf_text, "num_attention_heads", 1) or 1)

    def weights_for(ranges: list[tuple[int, int]]) -> list[int] | None:
        if not tensors:
            return None
        nkv = int(getattr(hf_text, "num_key_value_heads", None) or nq)
        tied = bool(getattr(hf_text, "tie_word_embeddings", False))
        return stage_weight_bytes(tensors, ranges, tp, nkv, dtype_bytes, tied)

    weights = weights_for([s.layers for s in stages])
    if weights is not None:
        for stage, w in zip(stages, weights, strict=True):
            stage.weight_bytes_per_rank = w
    kvt = vllm_config.kv_transfer_config
    plan = Plan(
        target=target,
        target_architecture=mc.architectures[0],
        num_layers=n_layers,
        pp_size=pc.pipeline_parallel_size,
        tp_size=pc.tensor_parallel_size,
        method=spec.method if spec is not None else None,
        num_speculative_tokens=spec.num_speculative_tokens if spec is not None else None,
        draft=draft,
        draft_architecture=draft_arch,
        draft_pp_size=draft_pp,
        aux_tap_ids=taps,
        stages=stages,
        kv_role=kvt.kv_role if kvt is not None else None,
        platform=platform,
        dtype=str(mc.dtype).removeprefix("torch."),
    )
    if spec is not None and spec.method == "dspark" and spec.draft_model_config is not None:
        plan.extra.update(_draft_bytes_by_role(spec, kvt, dtype_bytes, tp))
        stages[-1].draft_bytes_per_rank = _draft_bytes_per_rank(spec, kvt, dtype_bytes, tp)
        from vllm_dspark_pp.connectors.nixl_layers import nixl_plan_note

        if (note := nixl_plan_note(spec, kvt)) is not None:
            plan.extra["nixl"] = note
    if plan.method == "dspark" and plan.draft is not None and plan.pp_size > 1:
        _add_stage_balance(plan, vllm_config, draft_cost_layers, weights_for)
    elif draft_cost_layers is not None:
        plan.extra["stage balance"] = (
            "not computed (it needs PP > 1 and a DSpark draft): --draft-cost-layers unused"
        )
    for check in PLUGIN_CHECKS:
        errors = check(vllm_config)
        if errors:
            plan.accepted = False
            plan.messages += errors
    if platform == "cpu":
        plan.not_checked = _gpu_only_checks(vllm_config, requested_async)
    return plan


def _add_stage_balance(
    plan: Plan,
    vllm_config,
    draft_cost_layers: float | None,
    weights_for: Callable[[list[tuple[int, int]]], list[int] | None],
) -> None:
    """Price the stages of this PP deployment and recommend a ``VLLM_PP_LAYER_PARTITION``
    (:mod:`vllm_dspark_pp.stage_balance`). A split already set in the environment is the one
    in effect (vLLM built the stages above from it): it is priced, never replaced. Where the
    model's split differs from vLLM's default, each stage's target weights under both (one TP
    rank, ``weights_for`` of the stage ranges) show what the split moves in memory."""
    from vllm import envs as vllm_envs

    from vllm_dspark_pp.producer.roles import is_dspark_prefill_only

    if plan.num_layers < plan.pp_size:
        return  # rejected: a stage without layers
    spec, kvt = vllm_config.speculative_config, vllm_config.kv_transfer_config
    try:
        plan.layer_partition = stage_balance(
            vllm_config.model_config.hf_text_config,
            spec.draft_model_config.hf_config,
            int(spec.num_speculative_tokens),
            plan.pp_size,
            env_partition=vllm_envs.VLLM_PP_LAYER_PARTITION,
            draft_cost_layers=draft_cost_layers,
            context_only=kvt is not None and is_dspark_prefill_only(spec, kvt),
        )
    except CostModelError as exc:
        plan.extra["stage balance"] = f"not estimated: {exc}"
        return
    sb = plan.layer_partition
    if sb.improves:
        sb.default_weight_bytes_per_rank = weights_for(partition_ranges(sb.default.partition))
        sb.best_weight_bytes_per_rank = weights_for(partition_ranges(sb.best.partition))


def _checkpoint_ships(draft_dir: str) -> tuple[bool, bool]:
    """(embedding, LM head): whether the draft checkpoint in ``draft_dir`` ships its own (read
    from the safetensors headers only; a config-only folder ships neither)."""
    import glob
    import os

    embed = head = False
    for path in glob.glob(os.path.join(draft_dir, "*.safetensors")):
        try:
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                names = list(f.keys())
        except Exception:  # noqa: BLE001 - unreadable file: assume shared, as vLLM would
            continue
        embed |= any("embed_tokens" in n for n in names)
        head |= any("lm_head" in n for n in names)
    return embed, head


def _draft_bytes_per_rank(spec, kv_transfer_config, dtype_bytes: int, tp: int) -> int | None:
    """What one TP rank of the drafting stage holds of the drafter this role builds (the
    context-KV-only drafter on a DSpark prefill-only producer, else the full one); ``None`` for a
    family without a per-rank rule."""
    from vllm_dspark_pp.producer.families import draft_architectures, family_for
    from vllm_dspark_pp.producer.roles import is_dspark_prefill_only

    family = family_for(draft_architectures(spec))
    rule = DRAFT_BYTES_PER_RANK.get(family.name) if family is not None else None
    if rule is None:
        return None
    own_embed, own_head = _checkpoint_ships(spec.draft_model_config.model)
    b = rule(spec.draft_model_config.hf_config, dtype_bytes, own_embed, own_head, tp)
    producer = kv_transfer_config is not None and is_dspark_prefill_only(spec, kv_transfer_config)
    return b["context_only" if producer else "full"]


def _draft_bytes_by_role(spec, kv_transfer_config, dtype_bytes: int, tp: int = 1) -> dict[str, str]:
    """Draft bytes this instance holds on the drafting GPU (full drafter vs context-KV-only on
    producers), by the memory rule the draft's family registers (producer/families.py)."""
    from vllm_dspark_pp.producer.families import draft_architectures, families, family_for
    from vllm_dspark_pp.producer.roles import is_dspark_prefill_only

    hf = spec.draft_model_config.hf_config
    family = family_for(draft_architectures(spec))
    if family is None or family.draft_memory is None:
        sized = " and ".join(f.name for f in families() if f.draft_memory is not None)
        return {"draft bytes": f"computed for {sized} drafts only"}
    own_embed, own_head = _checkpoint_ships(spec.draft_model_config.model)
    b = family.draft_memory(hf, dtype_bytes, own_embed, own_head)
    mib = 1024 * 1024
    shared = [n for n, own in (("embedding", own_embed), ("LM head", own_head)) if not own]
    out = {
        "draft bytes": (
            f"full drafter {b['full'] / mib:.2f} MiB (incl. {b['fused_kv_copy'] / mib:.2f} MiB "
            f"fused K/V copy), context-KV-only {b['context_only'] / mib:.2f} MiB (no copy; "
            f"{' and '.join(shared) or 'nothing'} shared with the target"
            + (f", {b['shared_with_target'] / mib:.2f} MiB" if shared else "")
            + ")"
        )
    }
    rule = DRAFT_BYTES_PER_RANK.get(family.name)
    if tp > 1 and rule is not None:
        r = rule(hf, dtype_bytes, own_embed, own_head, tp)
        out["draft bytes per TP rank"] = (
            f"full drafter {r['full'] / mib:.2f} MiB, context-KV-only "
            f"{r['context_only'] / mib:.2f} MiB on each of the TP={tp} ranks of the last stage "
            "(attention, MLP and vocab tables split; fc, norms and the Markov token table whole)"
        )
    if kv_transfer_config is not None:
        producer = is_dspark_prefill_only(spec, kv_transfer_config)
        out["this role builds"] = (
            "context-KV-only drafter (prefill-only producer)" if producer else "full drafter"
        )
    return out


def format_plan(plan: Plan) -> str:
    lines = [
        f"target      {plan.target} ({plan.target_architecture}, {plan.num_layers} layers)",
        f"parallel    PP={plan.pp_size} TP={plan.tp_size} ({plan.pp_size * plan.tp_size} ranks)   "
        f"(configs built on the {plan.platform} platform)",
    ]
    if plan.method:
        lines.append(
            f"speculative {plan.method}, k={plan.num_speculative_tokens}, draft {plan.draft} "
            f"({plan.draft_architecture}, draft-local PP={plan.draft_pp_size})"
        )
        lines.append(f"aux taps    {plan.aux_tap_ids} (tap L = output of target layer L-1)")
    else:
        lines.append("speculative none")
    if plan.kv_role:
        lines.append(f"kv role     {plan.kv_role}")
    lines.append("")
    lines.append("stage  layers        aux taps made  drafts  relays to next stage")
    for st in plan.stages:
        relay = (
            f"taps {st.relay_out_taps}: {st.relay_bytes_per_token} B/token"
            if st.relay_out_taps
            else "-"
        )
        if st.partial_relay_bytes_per_token != st.relay_bytes_per_token:
            relay += f" ({st.partial_relay_bytes_per_token} as a tap partial)"
        lines.append(
            f"{st.rank:>5}  [{st.layers[0]:>3}, {st.layers[1]:>3})    "
            f"{str(st.aux_taps):<13}  {'yes' if st.drafts and plan.method else 'no':<6}  {relay}"
        )
    if any(st.partial_relay_bytes_per_token != st.relay_bytes_per_token for st in plan.stages):
        lines.append(
            "            tap partial: VLLM_DSPARK_PP_TAP_PARTIALS=auto (opt-in) sends one partial "
            "sum of the drafter's first linear instead of the taps (docs/performance-bound.md)"
        )
    lines.append("")
    lines += _per_rank_lines(plan)
    for key, value in plan.extra.items():
        lines.append(f"{key}: {value}")
    if plan.layer_partition is not None:
        lines.append("")
        lines += format_stage_balance(plan.layer_partition)
    if plan.not_checked:
        lines.append("")
        lines.append("not checked on this machine (GPU-only):")
        lines += [f"  - {n}" for n in plan.not_checked]
    lines.append("")
    if plan.accepted:
        lines.append("verdict     ACCEPTED by vLLM 0.34.0 + vllm-dspark-pp")
    else:
        lines.append("verdict     REJECTED")
        lines += [f"  - {m}" for m in plan.messages]
    return "\n".join(lines)


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / (1024 * 1024):.2f} MiB"


def _per_rank_lines(plan: Plan) -> list[str]:
    """The memory one TP rank of each stage holds: target weights and, on the drafting stage,
    the drafter this role builds (KV cache and activations come on top, decided on the GPU)."""
    out = [
        f"per TP rank (TP={plan.tp_size}, {plan.dtype}; weights from the target's safetensors "
        "headers, divided where vLLM shards them)",
        "stage  global ranks      target weights  drafter         weights + drafter",
    ]
    for st in plan.stages:
        draft = st.draft_bytes_per_rank if st.drafts and plan.method else None
        known = [b for b in (st.weight_bytes_per_rank, draft) if b is not None]
        total = sum(known) if st.weight_bytes_per_rank is not None else None
        out.append(
            f"{st.rank:>5}  {str(st.global_ranks):<16}  {_mib(st.weight_bytes_per_rank):<14}  "
            f"{_mib(draft):<14}  {_mib(total)}"
        )
    if any(st.weight_bytes_per_rank is None for st in plan.stages):
        out.append("  (no *.safetensors in the target folder: target weights not sized)")
    return out
