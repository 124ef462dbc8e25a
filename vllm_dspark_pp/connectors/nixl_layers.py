"""What two NIXL peers must agree on for DSpark, as pure functions (issue 18).

vLLM 0.34.0's NIXL handshake (``nixl/base_worker.py``) checks two things that a DSpark
deployment trips over:

1. the **compatibility hash** (``nixl/metadata.py::compute_nixl_compatibility_hash``): it
   includes the speculative config of hidden-state drafters (method, draft model, KV dtype, aux
   layer ids). A decoder with DSpark and a prefiller without it differ here first, and vLLM
   says only "NIXL compatibility hash mismatch ... different vLLM versions, models, ...";
2. the **KV layer names** (``_pair_regions``): every local layer must exist on the peer and, at
   PP=1, every peer layer locally. vLLM names the missing layers but not what they are.

A DSpark prefill-only producer (``roles.is_dspark_prefill_only``) has the same speculative config
as its decoder and registers the draft's KV layers under the full drafter's names
(``producer/``), so both checks pass at PP=1. These helpers turn a failure of either check
into a message that names the cause (the draft layers) and the fix; they never fail a handshake
that vLLM would accept (``layer_mismatch_problem`` reports exactly vLLM's rule).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any

#: vLLM issue where users report "Number of KV layers must match" with DSpark on NIXL.
UPSTREAM_ISSUE = "vLLM issue #48221"

#: The decoder's log line when a peer's KV layers pair (draft layers included); tests parse it.
PAIRED_LOG = "NIXL KV layers match engine %s: %d target + %d draft layers%s"

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_REMOTE_HASH = re.compile(r"Remote:\s*([0-9a-fA-F]+)")

_FIX_SAME_SPEC = (
    "Start the prefiller with the same --speculative-config as the decoder (same DSpark draft "
    "model): with vllm-dspark-pp a kv_role='kv_producer' instance then builds only the draft's "
    "context-KV layers (no drafting), under the decoder's layer names."
)


def layer_sort_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Model-layer order (``layers.10`` after ``layers.9``), then by name."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name)
    )


def kv_layer_names(region_members: Iterable[Iterable[str]]) -> list[str]:
    """Every layer named in NIXL ``region_members`` (regions -> layer names), once, sorted."""
    seen = {name for names in region_members for name in names}
    return sorted(seen, key=layer_sort_key)


def is_draft_layer(name: str, num_target_layers: int) -> bool:
    """A speculative draft's KV layer: DSpark/DFlash number draft layers after the target's
    (``model.layers.<num_target_layers + i>...``); EAGLE-style drafts use a ``draft_model.``
    prefix."""
    if name.startswith("draft_model."):
        return True
    m = _LAYER_INDEX.search(name)
    return m is not None and int(m.group(1)) >= num_target_layers


def first_difference(
    local: Sequence[str], remote: Sequence[str]
) -> tuple[int, str | None, str | None] | None:
    """``(position, local name, remote name)`` of the first difference between the two lists
    sorted in model order (None = that list has ended), or None when they are equal."""
    a = sorted(local, key=layer_sort_key)
    b = sorted(remote, key=layer_sort_key)
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        if x != y:
            return i, x, y
    return None


def _summary(names: Sequence[str], num_target_layers: int | None) -> str:
    if num_target_layers is None:
        return f"{len(names)} layers"
    draft = [n for n in names if is_draft_layer(n, num_target_layers)]
    text = f"{len(names) - len(draft)} target + {len(draft)} draft layers"
    if draft:
        text += f" (draft: {', '.join(draft[:4])}{', ...' if len(draft) > 4 else ''})"
    return text


def layer_mismatch_problem(
    local: Sequence[str],
    remote: Sequence[str],
    *,
    remote_may_hold_more: bool,
    num_target_layers: int | None = None,
    remote_engine_id: str = "?",
) -> str | None:
    """Why vLLM's NIXL region pairing will refuse these layer lists (None when it will not).

    vLLM's rule (``_pair_regions``): every local layer must exist on the peer, and at PP=1
    (``remote_may_hold_more`` false) every peer layer must exist locally. The message names the
    first difference of both lists in model order, what each side holds (target and draft
    layers, when ``num_target_layers`` is known) and the fix for DSpark.
    """
    local_set, remote_set = set(local), set(remote)
    missing_remote = local_set - remote_set
    extra_remote = set() if remote_may_hold_more else remote_set - local_set
    if not missing_remote and not extra_remote:
        return None
    diff = first_difference(sorted(local_set), sorted(remote_set))
    assert diff is not None
    pos, here, there = diff
    loc = sorted(local_set, key=layer_sort_key)
    rem = sorted(remote_set, key=layer_sort_key)
    msg = (
        f"NIXL handshake with engine {remote_engine_id}: the KV layers differ between this "
        f"instance ({_summary(loc, num_target_layers)}) and the peer "
        f"({_summary(rem, num_target_layers)}). First difference at position {pos} of the "
        f"lists in model order: here {here if here is not None else '(end of list)'!s}, "
        f"peer {there if there is not None else '(end of list)'!s}."
    )
    if num_target_layers is not None:
        draft_here = [n for n in loc if is_draft_layer(n, num_target_layers)]
        draft_there = [n for n in rem if is_draft_layer(n, num_target_layers)]
        if draft_here and not draft_there:
            msg += (
                " The peer registers no speculative draft KV layers: DSpark on the decoder only "
                f"cannot run over NIXL ({UPSTREAM_ISSUE}). " + _FIX_SAME_SPEC
            )
        elif draft_there and not draft_here:
            msg += (
                " This instance registers no draft KV layers but the peer does: run both with "
                "the same --speculative-config."
            )
        elif draft_here != draft_there:
            msg += (
                " Both sides register draft KV layers, but not the same ones: the prefiller and "
                "the decoder must use the same DSpark draft model (same layer count and names)."
            )
    return msg


# ------------------------------------------------------------------ the compatibility hash
def hash_without_speculation(compute_hash, vllm_config: Any, *args: Any, **kwargs: Any) -> str:
    """vLLM's NIXL compatibility hash of ``vllm_config`` as if it had no speculative config,
    computed by vLLM's own ``compute_hash`` over a view of the config (nothing is copied)."""
    view = SimpleNamespace(
        model_config=vllm_config.model_config,
        cache_config=vllm_config.cache_config,
        scheduler_config=vllm_config.scheduler_config,
        parallel_config=getattr(vllm_config, "parallel_config", None),
        speculative_config=None,
    )
    return compute_hash(view, *args, **kwargs)


def remote_hash_in(message: str) -> str | None:
    """The peer's hash in vLLM's "NIXL compatibility hash mismatch" message."""
    m = _REMOTE_HASH.search(message)
    return m.group(1) if m else None


def hash_mismatch_hint(
    local_method: str | None, remote_hash: str | None, local_hash_without_spec: str | None
) -> str | None:
    """What to add to vLLM's hash-mismatch message for a DSpark instance (None: nothing)."""
    if local_method != "dspark":
        return None
    if remote_hash is not None and remote_hash == local_hash_without_spec:
        return (
            "vllm-dspark-pp: the peer's hash equals this instance's configuration WITHOUT its "
            "speculative config, so the peer (prefiller) runs no speculative decoding while this "
            f"decoder runs DSpark ({UPSTREAM_ISSUE}): its draft KV layers would not exist on the "
            "prefiller. " + _FIX_SAME_SPEC
        )
    return (
        "vllm-dspark-pp: this instance runs DSpark, and the NIXL hash includes the draft (method, "
        "draft model path, KV dtype, aux layers): the prefiller must use the same "
        "--speculative-config. " + _FIX_SAME_SPEC
    )


# ------------------------------------------------------------------ for `vllm-dspark-pp plan`
def nixl_plan_note(spec_config: Any, kv_transfer_config: Any) -> str | None:
    """One line for ``plan`` about a DSpark instance over a NIXL connector (None otherwise).

    Called on configs vLLM accepted, so a prefill-only producer here is at PP=1 (PP>1 is
    refused when the config is built: ``roles.prefill_only_connector_problem``)."""
    from vllm_dspark_pp.producer import roles

    if getattr(spec_config, "method", None) != "dspark":
        return None
    nixl = roles.nixl_connectors_in(kv_transfer_config)
    if not nixl:
        return None
    names = ", ".join(nixl)
    if roles.is_dspark_prefill_only(spec_config, kv_transfer_config):
        pp = roles.target_pp_size(spec_config)
        return (
            f"{names} with a DSpark prefill-only producer at PP={pp}: accepted; it registers the "
            "draft's context-KV layers under the decoder drafter's names, so the decoder must "
            "use the same --speculative-config"
        )
    return (
        f"{names} with DSpark on this instance: the prefiller must use the same "
        f"--speculative-config (DSpark on the decoder alone fails the NIXL handshake, "
        f"{UPSTREAM_ISSUE})"
    )
