"""Start-up checks of a DSpark speculative config that vLLM 0.34.0 does not make.

Each check runs when vLLM builds its ``VllmConfig`` (``patches/config_vllm.py``), so a bad
``vllm serve`` / ``LLM(...)`` fails before any process is spawned, with a message that names the
fix. Without them these configurations start and then misbehave:

* a draft that is not a DSpark drafter under ``"method": "dspark"`` (e.g. the target itself):
  vLLM 0.34.0 relabels any draft it does not recognize as a DeepSeek-V4 DSpark drafter
  (``DSparkDraftModel``, ``model_type`` deepseek_v4) and fails late, at model build (the
  DeepSeek-V4 family's own start check refuses that one, :func:`check_family`);
* ``num_speculative_tokens`` larger than the drafter's trained ``block_size``: the drafter is
  asked for query positions it was never trained on (vLLM accepts any k);
* drafter aux taps (``target_layer_ids``) beyond the target's depth: the tap is never produced,
  so with PP > 1 no stage relays it and the last stage waits for a tensor nobody sends.

See docs/bad-configs.md for the full table of refused configurations.
"""

from __future__ import annotations

from typing import Any

from vllm_dspark_pp.producer.drafter import DSparkConfigError
from vllm_dspark_pp.producer.families import draft_architectures, family_for

__all__ = ["DSparkConfigError", "check_dspark"]


def _draft_block_size(spec: Any) -> int | None:
    hf = spec.draft_model_config.hf_config
    for name in ("block_size", "dspark_block_size"):
        value = getattr(hf, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_is_dspark_draft(spec: Any) -> None:
    archs = draft_architectures(spec)
    if not any("dspark" in a.lower() for a in archs):
        raise DSparkConfigError(
            f"--speculative-config method 'dspark' needs a DSpark drafter, but the draft model "
            f"{spec.draft_model_config.model!r} has architectures {archs}. Point 'model' at a "
            f"DSpark draft checkpoint (its config.json lists a *DSpark* architecture), or use the "
            f"method that matches this draft (e.g. 'dflash', 'eagle3', 'draft_model')."
        )


def check_block_size(spec: Any) -> None:
    block = _draft_block_size(spec)
    k = spec.num_speculative_tokens
    if block is not None and k is not None and k > block:
        raise DSparkConfigError(
            f"--speculative-config num_speculative_tokens={k} exceeds the DSpark drafter's "
            f"block_size={block} (the number of positions it was trained to draft, config.json "
            f"of {spec.draft_model_config.model!r}). Set num_speculative_tokens to at most "
            f"{block} (or leave it out: vLLM then uses the block size)."
        )


def check_taps_within_target(vllm_config: Any) -> None:
    spec = vllm_config.speculative_config
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )

    taps = list(get_eagle3_aux_layers_from_config(spec) or ())
    num_layers = vllm_config.model_config.get_total_num_hidden_layers()
    # Aux id L is the residual stream entering target layer L (L = num_layers: after the last).
    bad = [t for t in taps if not 0 <= t <= num_layers]
    if bad:
        raise DSparkConfigError(
            f"the DSpark drafter {spec.draft_model_config.model!r} taps target layers "
            f"{[t - 1 for t in bad]} (its target_layer_ids), but the target "
            f"{vllm_config.model_config.model!r} has {num_layers} layers "
            f"(ids 0..{num_layers - 1}). "
            f"The drafter was trained for a deeper target: use the DSpark drafter trained for "
            f"this target."
        )


def check_family(vllm_config: Any) -> None:
    """The start checks the draft's family registers (producer/families.py), if it has one."""
    family = family_for(draft_architectures(vllm_config.speculative_config))
    for check in family.start_checks if family is not None else ():
        check(vllm_config)


def check_dspark(vllm_config: Any) -> None:
    """Run every check on a VllmConfig whose speculative method is DSpark (no-op otherwise)."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "dspark" or spec.draft_model_config is None:
        return
    check_family(vllm_config)
    check_is_dspark_draft(spec)
    check_block_size(spec)
    check_taps_within_target(vllm_config)
