"""The deployment plan: what vLLM 0.34.0 plus this plugin would do with a configuration.

Built from config.json files only (no weights, no GPU) through vLLM's own ``EngineArgs`` and
``VllmConfig``, so every validation vLLM runs at start-up runs here too. Pure functions of the
resulting config compute the per-stage layout; :mod:`vllm_dspark_pp.cli.plan` prints it.

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


@dataclass
class Stage:
    rank: int
    layers: tuple[int, int]  # [start, end)
    aux_taps: list[int]  # tap ids produced on this stage
    drafts: bool
    relay_out_taps: list[int]  # tap ids carried to the next stage
    relay_bytes_per_token: int  # aux-tap bytes per token sent to the next stage


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
    accepted: bool = True
    messages: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

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
    num_layers: int, pp_size: int, tap_ids: list[int], hidden_size: int, dtype_bytes: int
) -> list[Stage]:
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
            )
        )
    return stages


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
) -> Plan:
    """Build vLLM's config for this deployment and describe it. Raises on vLLM's own rejection."""
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
    plan = describe(vllm_config, target, requested_async, current_platform.device_name)
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


def describe(vllm_config, target: str, requested_async=None, platform: str = "?") -> Plan:
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
    stages = build_plan_stages(
        n_layers, pc.pipeline_parallel_size, taps, mc.get_hidden_size(), dtype_bytes
    )
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
    )
    if spec is not None and spec.method == "dspark" and spec.draft_model_config is not None:
        plan.extra.update(_draft_bytes_by_role(spec, kvt, dtype_bytes))
        from vllm_dspark_pp.connectors.nixl_layers import nixl_plan_note

        if (note := nixl_plan_note(spec, kvt)) is not None:
            plan.extra["nixl"] = note
    for check in PLUGIN_CHECKS:
        errors = check(vllm_config)
        if errors:
            plan.accepted = False
            plan.messages += errors
    if platform == "cpu":
        plan.not_checked = _gpu_only_checks(vllm_config, requested_async)
    return plan


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


def _draft_bytes_by_role(spec, kv_transfer_config, dtype_bytes: int) -> dict[str, str]:
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
    if kv_transfer_config is not None:
        producer = is_dspark_prefill_only(spec, kv_transfer_config)
        out["this role builds"] = (
            "context-KV-only drafter (prefill-only producer)" if producer else "full drafter"
        )
    return out


def format_plan(plan: Plan) -> str:
    lines = [
        f"target      {plan.target} ({plan.target_architecture}, {plan.num_layers} layers)",
        f"parallel    PP={plan.pp_size} TP={plan.tp_size}   (configs built on the {plan.platform} "
        f"platform)",
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
        lines.append(
            f"{st.rank:>5}  [{st.layers[0]:>3}, {st.layers[1]:>3})    "
            f"{str(st.aux_taps):<13}  {'yes' if st.drafts and plan.method else 'no':<6}  {relay}"
        )
    for key, value in plan.extra.items():
        lines.append(f"{key}: {value}")
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
