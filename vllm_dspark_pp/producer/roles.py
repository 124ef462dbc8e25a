"""Who this vLLM instance is, as pure functions of vLLM's config objects.

Role semantics (documented in docs/producer.md):

* A **DSpark prefill-only producer** is an instance whose speculative method is ``dspark`` and
  whose KV-transfer config makes it a pure KV producer: a connector is configured, at least one
  connector role is ``kv_producer`` and none is ``kv_consumer`` or ``kv_both``
  (``KVTransferConfig.is_kv_producer and not is_kv_consumer``; with ``MultiConnector`` the
  children's roles count, as in vLLM). Such an instance never verifies drafts it proposed
  itself, so it only needs the draft's context KV: it builds the context-KV-only drafter.
* ``kv_both`` decodes too, so it keeps the full drafter (it is *not* prefill-only).
* ``kv_consumer`` (the decode side) keeps the full drafter.

The role is decided in one place, :func:`prefill_only_role`, from the instance's ``VllmConfig``
(its speculative and KV-transfer configs); every caller (config check, scheduler, model runner,
speculator, ``plan``) has that config at hand, including the workers, which receive the whole
``VllmConfig``. (An earlier version attached the KV-transfer config to the SpeculativeConfig in a
side table carried through pickling; nothing needed it, so it is gone.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, ParallelConfig, SpeculativeConfig, VllmConfig

#: Connectors whose PP>1 producer path with a context-only drafter is not proven correct.
NIXL_CONNECTORS: tuple[str, ...] = ("NixlConnector", "NixlPullConnector", "NixlPushConnector")

#: The supported path for PP>1 DSpark prefill-only producers.
SUPPORTED_PP_PRODUCER_CONNECTOR = "MooncakeConnector"


# --------------------------------------------------------------------------- roles
def is_pure_kv_producer(kv_transfer_config: KVTransferConfig | None) -> bool:
    """A connector is configured and this instance only produces KV (never consumes)."""
    if kv_transfer_config is None or kv_transfer_config.kv_connector is None:
        return False
    return bool(kv_transfer_config.is_kv_producer) and not kv_transfer_config.is_kv_consumer


def is_dspark_prefill_only(
    spec_config: SpeculativeConfig | None, kv_transfer_config: KVTransferConfig | None
) -> bool:
    """DSpark speculative decoding on a pure KV producer (``kv_role=kv_producer``)."""
    if spec_config is None or getattr(spec_config, "method", None) != "dspark":
        return False
    return is_pure_kv_producer(kv_transfer_config)


def prefill_only_role(vllm_config: VllmConfig) -> bool:
    """Whether this instance is a DSpark prefill-only producer: the one role decision."""
    return is_dspark_prefill_only(vllm_config.speculative_config, vllm_config.kv_transfer_config)


def target_pp_size(
    spec_config: SpeculativeConfig | None, parallel_config: ParallelConfig | None = None
) -> int:
    if parallel_config is None and spec_config is not None:
        parallel_config = getattr(spec_config, "target_parallel_config", None)
    if parallel_config is None:
        return 1
    return int(parallel_config.pipeline_parallel_size)


# --------------------------------------------------------------------------- connectors
def configured_connectors(kv_transfer_config: KVTransferConfig | None) -> list[str]:
    """Every connector name configured, walking MultiConnector children at any depth."""
    if kv_transfer_config is None or kv_transfer_config.kv_connector is None:
        return []
    names: list[str] = []

    def walk(name: str | None, extra: dict[str, Any] | None) -> None:
        if name is None:
            return
        names.append(name)
        if name == "MultiConnector":
            for child in (extra or {}).get("connectors", []) or []:
                walk(child.get("kv_connector"), child.get("kv_connector_extra_config"))

    walk(kv_transfer_config.kv_connector, kv_transfer_config.kv_connector_extra_config)
    return names


def nixl_connectors_in(kv_transfer_config: KVTransferConfig | None) -> list[str]:
    """The NIXL connectors configured (directly or inside MultiConnector), in order."""
    if kv_transfer_config is None:
        return []
    found = [n for n in NIXL_CONNECTORS if kv_transfer_config.has_connector(n)]
    # has_connector() looks one MultiConnector level deep; walk deeper nestings too.
    for name in configured_connectors(kv_transfer_config):
        if name in NIXL_CONNECTORS and name not in found:
            found.append(name)
    return found


def prefill_only_connector_problem(
    spec_config: SpeculativeConfig | None,
    kv_transfer_config: KVTransferConfig | None,
    parallel_config: ParallelConfig | None = None,
) -> str | None:
    """Why this connector setup cannot run (None when it can): a DSpark prefill-only producer
    under PP>1 over a NIXL connector. Pure function, usable by ``plan``."""
    if not is_dspark_prefill_only(spec_config, kv_transfer_config):
        return None
    pp = target_pp_size(spec_config, parallel_config)
    if pp <= 1:
        return None
    nixl = nixl_connectors_in(kv_transfer_config)
    if not nixl:
        return None
    return (
        f"DSpark prefill-only producer (kv_role=kv_producer) with pipeline_parallel_size={pp} "
        f"over {', '.join(nixl)} is not supported by vllm-dspark-pp: the NIXL path for the "
        "draft's context KV from a PP>1 producer is not proven correct. Use "
        f"{SUPPORTED_PP_PRODUCER_CONNECTOR} (kv_connector='{SUPPORTED_PP_PRODUCER_CONNECTOR}'), "
        "or run the producer with pipeline_parallel_size=1."
    )


def check_prefill_only_connectors(
    spec_config: SpeculativeConfig | None,
    kv_transfer_config: KVTransferConfig | None,
    parallel_config: ParallelConfig | None = None,
) -> None:
    """Raise NotImplementedError for a setup :func:`prefill_only_connector_problem` rejects."""
    problem = prefill_only_connector_problem(spec_config, kv_transfer_config, parallel_config)
    if problem is not None:
        raise NotImplementedError(problem)
