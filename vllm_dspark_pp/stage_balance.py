"""Stage balance under PP around the last-stage DSpark drafter: a cost model and a layer split.

With PP the last stage runs its target layers, the target's LM head and the DSpark drafter
(context K/V precompute, one parallel query pass, the draft logits and the ``k`` sequential
Markov sampling steps) once per micro-batch, so with vLLM's even split it is the slowest stage.
vLLM 0.34.0 lets a deployment split the layers unevenly with ``VLLM_PP_LAYER_PARTITION``
(``vllm/distributed/utils.py``, ``get_pp_indices``: comma-separated layer counts, one per PP
rank, summing to the layer count). This module prices each stage and picks the split that
minimises the most expensive stage, every stage keeping at least one layer.

The cost model (an ESTIMATE, not a measurement): **multiply-adds per verified token**, i.e. the
matmul weights each token is multiplied with. A decode step verifies ``1 + k`` tokens per request
and every one of them passes every target layer, so a target layer costs its projections (Q, K/V,
O; MLA's low-rank ones where the config has ``kv_lora_rank``) plus its MLP (gated, three
matrices; an MoE layer its router, the ``top-k`` routed experts a token activates and its shared
experts). The drafter, per verified token: the context K/V of every verified token (``fc`` over the
target's aux taps, then each draft layer's K/V projection), the query pass over ``1 + k`` tokens a
request (every draft layer whole), and for the ``k`` drafted positions the draft-vocabulary logits
and the Markov bias (rank x draft vocabulary, one sequential step each): those two scale with
``k / (1 + k)``. The last stage also computes the target's logits for every verified token (LM
head). A DSpark prefill-only producer builds only the context part and computes logits for one
position a prompt (neither head counts). Left out: attention over the KV cache (grows with the
context, in target and draft layers alike), norms, rotary, sampling arithmetic, the launch
latency of the ``k`` sequential steps, the PP transfers, and TP (it divides target and drafter
alike). Costs are printed in target-layer units (the mean target layer = 1).

A measured override: ``draft_cost_layers`` (``vllm-dspark-pp plan --draft-cost-layers X``) says
the drafter costs X target layers (e.g. the draft step's time over one target layer's time at
PP=1, docs/plan.md); it replaces the modelled drafter, the LM head stays modelled.

Pure functions of config objects or dicts; :mod:`vllm_dspark_pp.deployment_plan` calls
:func:`stage_balance` and prints the result.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

ENV = "VLLM_PP_LAYER_PARTITION"
COST_MODEL = (
    "multiply-adds per verified token (matmul weights; MoE: the routed experts a token activates "
    "plus shared experts), in units of the mean target layer; leaves out attention over the KV "
    "cache, norms, sampling arithmetic, kernel-launch latency and the PP transfers"
)
# A split counts as better only when it lowers the bottleneck by more than this fraction.
_REL_TOL = 1e-9


class CostModelError(ValueError):
    """A config lacks a field the cost model needs."""


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` that ``cfg`` (an object or a dict) has and is not None."""
    for name in names:
        value = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
        if value is not None:
            return value
    return default


def _need(cfg: Any, *names: str) -> int:
    value = _get(cfg, *names)
    if value is None:
        raise CostModelError(f"config has no {' / '.join(names)}")
    return int(value)


# ------------------------------------------------------------------ the cost model
def attention_macs(cfg: Any) -> tuple[int, int]:
    """(all projections, the K/V write alone): multiply-adds per token of one attention layer.

    MLA (``kv_lora_rank`` set): Q (through ``q_lora_rank`` when set), the latent down-projection
    (the part a K/V write needs), its up-projection to keys and values, O. Otherwise Q (through
    ``q_lora_rank`` when set), K and V over the KV heads (the K/V write), O (through
    ``o_lora_rank`` when set)."""
    h = _need(cfg, "hidden_size")
    nq = _need(cfg, "num_attention_heads")
    q_lora = int(_get(cfg, "q_lora_rank", default=0) or 0)
    kv_lora = int(_get(cfg, "kv_lora_rank", default=0) or 0)
    if kv_lora:
        rope = int(_get(cfg, "qk_rope_head_dim", default=0))
        nope = int(_get(cfg, "qk_nope_head_dim", default=0))
        v = int(_get(cfg, "v_head_dim", default=nope))
        q_dim = nq * (nope + rope)
        q = h * q_lora + q_lora * q_dim if q_lora else h * q_dim
        kv_write = h * (kv_lora + rope)
        kv_up = kv_lora * nq * (nope + v)
        return q + kv_write + kv_up + nq * v * h, kv_write
    hd = int(_get(cfg, "head_dim", default=0) or h // nq)
    nkv = int(_get(cfg, "num_key_value_heads", default=nq))
    q = h * q_lora + q_lora * nq * hd if q_lora else h * nq * hd
    kv_write = 2 * h * nkv * hd
    o_lora = int(_get(cfg, "o_lora_rank", default=0) or 0)
    o = nq * hd * o_lora + o_lora * h if o_lora else nq * hd * h
    return q + kv_write + o, kv_write


def _num_experts(cfg: Any) -> tuple[int, int]:
    """(routed experts, experts a token activates); (0, 0) for a dense model."""
    experts = int(_get(cfg, "n_routed_experts", "num_experts", "num_local_experts", default=0))
    top_k = int(_get(cfg, "num_experts_per_tok", "num_experts_per_token", "moe_topk", default=0))
    return (experts, top_k) if experts > 0 and top_k > 0 else (0, 0)


def is_moe_layer(cfg: Any, layer: int) -> bool:
    """Whether target layer ``layer`` has an MoE MLP, by the config fields DeepSeek-style
    (``first_k_dense_replace``, ``moe_layer_freq``) and Qwen-MoE-style (``decoder_sparse_step``,
    ``mlp_only_layers``) models use."""
    if _num_experts(cfg) == (0, 0):
        return False
    if layer < int(_get(cfg, "first_k_dense_replace", default=0)):
        return False
    if layer % max(1, int(_get(cfg, "moe_layer_freq", default=1))) != 0:
        return False
    if layer in (_get(cfg, "mlp_only_layers", default=()) or ()):
        return False
    return (layer + 1) % max(1, int(_get(cfg, "decoder_sparse_step", default=1))) == 0


def mlp_macs(cfg: Any, layer: int = 0) -> int:
    """Multiply-adds per token of layer ``layer``'s MLP: gated (gate, up, down); an MoE layer's
    router, its active routed experts and its shared experts."""
    h = _need(cfg, "hidden_size")
    if not is_moe_layer(cfg, layer):
        return 3 * h * _need(cfg, "intermediate_size")
    experts, top_k = _num_experts(cfg)
    expert = int(_get(cfg, "moe_intermediate_size", "intermediate_size", default=0))
    shared_size = _get(cfg, "shared_expert_intermediate_size")
    if shared_size is not None:
        shared = 3 * h * int(shared_size)  # one shared expert of its own width (Qwen2-MoE)
    else:
        shared = (
            int(_get(cfg, "n_shared_experts", "num_shared_experts", default=0)) * 3 * h * expert
        )
    return h * experts + top_k * 3 * h * expert + shared


def layer_macs(cfg: Any, layer: int = 0) -> int:
    return attention_macs(cfg)[0] + mlp_macs(cfg, layer)


def target_layer_costs(cfg: Any) -> list[int]:
    """Each target layer's multiply-adds per token (every layer's attention priced alike: a
    hybrid target's linear-attention layers get its main attention's figure)."""
    return [layer_macs(cfg, i) for i in range(_need(cfg, "num_hidden_layers"))]


def _num_aux_taps(cfg: Any) -> int:
    ids = _get(cfg, "dspark_target_layer_ids", "target_layer_ids") or (
        _get(cfg, "dflash_config", default={}) or {}
    ).get("target_layer_ids")
    return len(ids) if ids else _need(cfg, "num_hidden_layers")


def draft_macs(draft_cfg: Any, k: int, target_hidden: int, context_only: bool = False) -> dict:
    """The DSpark drafter's multiply-adds per verified token, by part (module docstring).

    ``context``: ``fc`` (aux taps x target hidden -> draft hidden) and every draft layer's K/V
    write; ``query``: every draft layer whole (``1 + k`` query tokens a request, one per verified
    token); ``logits``: the draft-vocabulary projection at the ``k`` drafted positions; ``markov``:
    the Markov bias (rank x draft vocabulary) of the ``k`` sequential steps. A prefill-only
    producer's context-KV-only drafter has the context part only."""
    h = _need(draft_cfg, "hidden_size")
    layers = _need(draft_cfg, "num_hidden_layers")
    context = _num_aux_taps(draft_cfg) * int(_get(draft_cfg, "target_hidden_size") or target_hidden)
    context = context * h + layers * attention_macs(draft_cfg)[1]
    parts = {"context": context, "query": 0.0, "logits": 0.0, "markov": 0.0}
    if context_only:
        return parts
    vocab = _need(draft_cfg, "vocab_size")
    draft_vocab = int(_get(draft_cfg, "draft_vocab_size", default=vocab))
    rank = int(_get(draft_cfg, "markov_rank", "dspark_markov_rank", default=0) or 0)
    drafted = k / (1 + k)  # drafted positions per verified token
    parts["query"] = sum(layer_macs(draft_cfg, i) for i in range(layers))
    parts["logits"] = drafted * h * draft_vocab
    parts["markov"] = drafted * rank * draft_vocab
    return parts


def lm_head_macs(cfg: Any) -> int:
    return _need(cfg, "hidden_size") * _need(cfg, "vocab_size")


# ------------------------------------------------------------------ the split
def vllm_default_partition(num_layers: int, pp: int) -> list[int]:
    """vLLM 0.34.0's split without ``VLLM_PP_LAYER_PARTITION`` (``get_pp_indices``): equal
    shares, the remainder one layer each to the stages before the last, nearest to it first."""
    parts = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        parts[pp - 2 - i] += 1
    return parts


def parse_partition(text: str) -> list[int]:
    """``"a,b,..."`` as vLLM reads it (integers separated by commas)."""
    return [int(x) for x in text.split(",")]


def partition_ranges(partition: list[int]) -> list[tuple[int, int]]:
    """Each stage's [start, end) layers under ``partition``."""
    ends = list(itertools.accumulate(partition))
    return [(end - n, end) for n, end in zip(partition, ends, strict=True)]


def stage_costs(partition: list[int], layer_costs: list[float], last_extra: float) -> list[float]:
    """Each stage's cost: its layers' costs, plus ``last_extra`` on the last stage."""
    out, start = [], 0
    for n in partition:
        out.append(float(sum(layer_costs[start : start + n])))
        start += n
    out[-1] += last_extra
    return out


def best_partition(layer_costs: list[float], pp: int, last_extra: float) -> list[int]:
    """The contiguous split of the layers into ``pp`` stages of at least one layer each that
    minimises the most expensive stage (``last_extra`` added to the last); among the splits
    that reach it, the one with the smallest sum of squared stage costs (then the first found).

    Two dynamic programmes over (stage, layers covered so far), O(pp * n^2)."""
    n = len(layer_costs)
    if not 1 <= pp <= n:
        raise ValueError(f"{pp} stages of at least one layer need at least {pp} layers, not {n}")
    prefix = [0.0, *itertools.accumulate(float(c) for c in layer_costs)]

    def cost(stage: int, i: int, j: int) -> float:  # stage covering layers [i, j)
        return prefix[j] - prefix[i] + (last_extra if stage == pp - 1 else 0.0)

    inf = float("inf")
    # bottleneck[s][j]: the least possible max cost of stages 0..s covering layers [0, j)
    bottleneck = [[inf] * (n + 1) for _ in range(pp)]
    for j in range(1, n + 1):
        bottleneck[0][j] = cost(0, 0, j)
    for s in range(1, pp):
        for j in range(s + 1, n + 1):
            bottleneck[s][j] = min(max(bottleneck[s - 1][i], cost(s, i, j)) for i in range(s, j))
    limit = bottleneck[pp - 1][n] * (1 + _REL_TOL) + _REL_TOL
    # squares[s][j]: the least sum of squared costs of such stages, each within the limit
    squares = [[inf] * (n + 1) for _ in range(pp)]
    choice = [[0] * (n + 1) for _ in range(pp)]
    for j in range(1, n + 1):
        if cost(0, 0, j) <= limit:
            squares[0][j] = cost(0, 0, j) ** 2
    for s in range(1, pp):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                c = cost(s, i, j)
                if c <= limit and squares[s - 1][i] + c * c < squares[s][j]:
                    squares[s][j], choice[s][j] = squares[s - 1][i] + c * c, i
    partition, j = [], n
    for s in range(pp - 1, 0, -1):
        i = choice[s][j]
        partition.append(j - i)
        j = i
    partition.append(j)
    return partition[::-1]


# ------------------------------------------------------------------ the recommendation
@dataclass
class Split:
    partition: list[int]
    stage_costs: list[float]
    bottleneck: float


@dataclass
class StageBalance:
    """What ``plan`` prints under "stage balance" and puts in its JSON (``layer_partition``)."""

    cost_model: str
    role: str  # "decode (full drafter)" or "prefill-only producer (context-KV-only drafter)"
    num_speculative_tokens: int
    layer_macs_mean: float  # multiply-adds per token of the mean target layer (the unit)
    layer_costs: list[float]  # each target layer, in units of the mean layer
    lm_head_cost_layers: float  # the target's LM head on the last stage
    draft_cost_layers: float  # the drafter on the last stage (modelled or measured)
    draft_cost_source: str  # "cost model" or "measured (--draft-cost-layers)"
    draft_parts_layers: dict[str, float]  # the modelled drafter by part
    default: Split  # vLLM's split without VLLM_PP_LAYER_PARTITION
    best: Split  # the cost model's split
    env_partition: list[int] | None  # VLLM_PP_LAYER_PARTITION as set in the environment
    in_effect: Split  # the split vLLM uses (the environment's, else its default)
    improves: bool  # best's bottleneck is below the default's
    export: str | None  # the line to export; None when the default is kept or the env is set
    notes: list[str] = field(default_factory=list)
    # target weight bytes one TP rank of each stage holds under each split (set by the plan
    # when the target folder has safetensors headers)
    default_weight_bytes_per_rank: list[int] | None = None
    best_weight_bytes_per_rank: list[int] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _split(partition: list[int], layer_costs: list[float], last_extra: float) -> Split:
    costs = stage_costs(partition, layer_costs, last_extra)
    return Split(list(partition), costs, max(costs))


def stage_balance(
    target_cfg: Any,
    draft_cfg: Any,
    k: int,
    pp: int,
    env_partition: str | None = None,
    draft_cost_layers: float | None = None,
    context_only: bool = False,
) -> StageBalance:
    """The stage costs of vLLM's default split, of ``env_partition`` (``VLLM_PP_LAYER_PARTITION``
    as set, which vLLM then uses) and of the cost model's best split, for a PP=``pp`` target with
    a DSpark drafter of ``k`` speculative tokens on its last stage. Raises
    :class:`CostModelError` when a config lacks a field the model needs."""
    raw = target_layer_costs(target_cfg)
    unit = sum(raw) / len(raw)
    layer_costs = [c / unit for c in raw]
    parts = draft_macs(draft_cfg, k, _need(target_cfg, "hidden_size"), context_only)
    parts_layers = {name: v / unit for name, v in parts.items()}
    lm_head = 0.0 if context_only else lm_head_macs(target_cfg) / unit
    if draft_cost_layers is not None:
        if draft_cost_layers < 0:
            raise ValueError(f"draft cost {draft_cost_layers} target layers: must be >= 0")
        draft, source = float(draft_cost_layers), "measured (--draft-cost-layers)"
    else:
        draft, source = sum(parts_layers.values()), "cost model"
    extra = lm_head + draft
    default = _split(vllm_default_partition(len(raw), pp), layer_costs, extra)
    best = _split(best_partition(layer_costs, pp, extra), layer_costs, extra)
    improves = best.bottleneck < default.bottleneck * (1 - _REL_TOL)
    if not improves:
        best = default  # keep vLLM's split when the model finds nothing better
    env = parse_partition(env_partition) if env_partition else None
    if env is not None and (len(env) != pp or sum(env) != len(raw) or min(env) < 0):
        raise ValueError(f"{ENV}={env_partition}: not {pp} layer counts summing to {len(raw)}")
    in_effect = _split(env, layer_costs, extra) if env is not None else default
    notes = []
    if env is not None:
        notes.append(f"{ENV}={env_partition} is set in this environment and is in effect")
    return StageBalance(
        cost_model=COST_MODEL,
        role=(
            "prefill-only producer (context-KV-only drafter)"
            if context_only
            else "decode (full drafter)"
        ),
        num_speculative_tokens=k,
        layer_macs_mean=unit,
        layer_costs=layer_costs,
        lm_head_cost_layers=lm_head,
        draft_cost_layers=draft,
        draft_cost_source=source,
        draft_parts_layers=parts_layers,
        default=default,
        best=best,
        env_partition=env,
        in_effect=in_effect,
        improves=improves,
        export=f"{ENV}={','.join(map(str, best.partition))}" if improves and env is None else None,
        notes=notes,
    )


def _row(label: str, split: Split, default: Split | None = None) -> str:
    part = ",".join(map(str, split.partition))
    costs = " | ".join(f"{c:.2f}" for c in split.stage_costs)
    change = (
        f" ({(split.bottleneck / default.bottleneck - 1) * 100:+.1f}%)"
        if default is not None
        else ""
    )
    return f"  {label:<26} {part:<14} {costs:<30} {split.bottleneck:.2f}{change}"


def _mib(values: list[int]) -> str:
    return " | ".join(f"{v / 2**20:.2f}" for v in values) + " MiB"


def format_stage_balance(sb: StageBalance) -> list[str]:
    """The "stage balance" block of ``plan``'s text output."""
    parts = ", ".join(f"{k} {v:.2f}" for k, v in sb.draft_parts_layers.items() if v)
    drafter = (
        f"{sb.draft_cost_layers:.2f} (cost model, {sb.role}, k={sb.num_speculative_tokens}: "
        f"{parts})"
        if sb.draft_cost_source == "cost model"
        else f"{sb.draft_cost_layers:.2f} ({sb.draft_cost_source}; the cost model says "
        f"{sum(sb.draft_parts_layers.values()):.2f})"
    )
    lines = [
        "stage balance: an ESTIMATE from a cost model, not a measurement (docs/plan.md)",
        f"  cost model   one target layer = {sb.layer_macs_mean / 1e6:.2f} M multiply-adds per "
        "token (decode: each verified token; MoE: the active experts); leaves out attention "
        "over the KV cache, norms, sampling arithmetic, kernel-launch latency and the PP "
        "transfers",
        f"  last stage   also runs the target LM head {sb.lm_head_cost_layers:.2f} and the "
        f"drafter {drafter}",
        f"  {'split':<26} {'layers':<14} {'stage costs':<30} bottleneck",
        _row("vLLM's default", sb.default),
    ]
    if sb.env_partition is not None:
        lines.append(_row("in effect (environment)", sb.in_effect, sb.default))
    if sb.improves:
        lines.append(_row("cost model's", sb.best, sb.default))
    best = ",".join(map(str, sb.best.partition))
    if sb.env_partition is not None:
        same = sb.best.partition == sb.env_partition
        lines.append(
            f"  {ENV}={','.join(map(str, sb.env_partition))} is set in this environment and is "
            "in effect (the stages above use it); "
            + ("the cost model picks the same split" if same else f"the cost model picks {best}")
        )
    elif sb.export is not None:
        lines.append(f"  to use it:   export {sb.export}")
    else:
        lines.append(f"  vLLM's default split is the cost model's best: keep it (no {ENV})")
    if sb.best_weight_bytes_per_rank and sb.default_weight_bytes_per_rank and sb.improves:
        lines.append(
            f"  memory:      target weights per TP rank with {best}: "
            f"{_mib(sb.best_weight_bytes_per_rank)} (default split: "
            f"{_mib(sb.default_weight_bytes_per_rank)}); a stage's KV cache per token grows "
            "with its layers and vLLM gives every stage the block count of the fullest one"
        )
    lines.append(
        "  measure before relying on it: the draft step's time over one target layer's time at "
        "PP=1 is --draft-cost-layers; compare served throughput with and without the split"
    )
    return lines
