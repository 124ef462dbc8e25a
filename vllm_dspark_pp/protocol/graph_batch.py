"""The optional fixed DSpark draft graph batch size.

Set it inside ``--speculative-config`` (or ``LLM(speculative_config={...})``) with the key
:data:`KEY`::

    vllm serve <target> --pipeline-parallel-size 2 \\
        --speculative-config '{"method": "dspark", "model": "<drafter>",
                               "num_speculative_tokens": 5, "dspark_pp_fixed_graph_batch": 8}'

vLLM's config classes reject unknown fields, so the plugin takes the key out of the dict before
vLLM validates it (patches/engine_arg_utils__protocol.py) and records the value in
``VllmConfig.additional_config["vllm_dspark_pp"]["fixed_graph_batch"]``, which every worker
receives with the config. The PP handshake checks that every rank has the same value.

Effect: whenever the step's request count (the DP-wide maximum under data parallelism) is at most
``B``, the DSpark drafter's query pass is dispatched as a ``B``-request batch (``B * q`` tokens,
``q`` = the drafter's query tokens per request), so it replays one captured graph shape instead
of one per batch size. Because that re-pins the dispatch shape, the DP-sync state the drafter
reuses from the target step is rebuilt with ``B * q`` tokens on every DP rank (otherwise the
reused sync would describe a different token count than the one that runs). Larger batches are
dispatched as without the key. Capture a decode graph of ``B * q`` tokens for the drafter
(``cudagraph_capture_sizes``) or the pinned batch runs eagerly at the padded size.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

KEY = "dspark_pp_fixed_graph_batch"
ADDITIONAL_CONFIG_KEY = "vllm_dspark_pp"
MANAGER_ATTR = "_vllm_dspark_pp_fixed_batch"


class FixedGraphBatchError(ValueError):
    pass


def take_from_spec_dict(spec: dict | None) -> tuple[dict | None, int | None]:
    """Remove :data:`KEY` (or its dashed spelling) from a speculative-config dict."""
    if not spec:
        return spec, None
    value = None
    for k in (KEY, KEY.replace("_", "-")):
        if k in spec:
            value = spec.pop(k)
    if value is None:
        return spec, None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FixedGraphBatchError(
            f"--speculative-config {KEY!r} must be a positive integer (a request count), "
            f"got {value!r}; set it to a whole number between 1 and --max-num-seqs (e.g. 8), "
            f"or remove the key"
        )
    return spec, value


def validate(vllm_config: Any, value: int) -> None:
    spec = vllm_config.speculative_config
    method = getattr(spec, "method", None)
    if method != "dspark":
        raise FixedGraphBatchError(
            f"--speculative-config {KEY!r} applies to method 'dspark' only, but the method is "
            f"{method!r}; remove the key or use DSpark."
        )
    max_num_seqs = vllm_config.scheduler_config.max_num_seqs
    if value > max_num_seqs:
        raise FixedGraphBatchError(
            f"--speculative-config {KEY!r}={value} exceeds --max-num-seqs={max_num_seqs}; "
            f"use a value of at most {max_num_seqs}."
        )


def record(vllm_config: Any, value: int | None) -> None:
    if value is None:
        return
    validate(vllm_config, value)
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        raise FixedGraphBatchError(
            f"--speculative-config {KEY!r} needs additional_config to be a dict"
        )
    extra.setdefault(ADDITIONAL_CONFIG_KEY, {})["fixed_graph_batch"] = int(value)


def fixed_graph_batch(vllm_config: Any) -> int | None:
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict):
        return None
    value = extra.get(ADDITIONAL_CONFIG_KEY, {}).get("fixed_graph_batch")
    return None if value is None else int(value)


def pinned_dispatch(
    fixed_batch: int,
    num_reqs: int,
    num_tokens: int,
    uniform_token_count: int | None,
    dp_sync_state: Any | None,
) -> tuple[int, Any | None]:
    """``(num_tokens, dp_sync_state)`` to dispatch the drafter's query pass with.

    Pins the shape to ``fixed_batch * q`` tokens when the (DP-wide) request count fits, and then
    rebuilds the reused DP-sync state so every DP rank reports that token count.
    """
    if not fixed_batch or not uniform_token_count:
        return num_tokens, dp_sync_state
    if dp_sync_state is not None and dp_sync_state.eager:
        return num_tokens, dp_sync_state  # the ranks agreed on eager: no shape to pin
    reqs = dp_sync_state.num_reqs if dp_sync_state is not None else num_reqs
    pinned = fixed_batch * uniform_token_count
    if reqs > fixed_batch or num_tokens > pinned:
        return num_tokens, dp_sync_state
    if dp_sync_state is not None:
        import torch

        dp_sync_state = replace(
            dp_sync_state,
            num_tokens_across_dp=torch.full_like(dp_sync_state.num_tokens_across_dp, pinned),
            uniform_token_count=uniform_token_count,
            max_query_len=uniform_token_count,
        )
    return pinned, dp_sync_state
