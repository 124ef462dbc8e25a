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
* ``use_dspark_last_stage_drafter``: DSpark under a PP>1 target always drafts on the last
  pipeline stage, with a draft-local PP=1 parallel config (vLLM builds the speculator only on
  the last PP rank; ``dspark/utils.py::_get_dspark_parallel_config`` forces PP=1).

The speculative config must see the instance's KV-transfer config, but vLLM's config
dataclasses forbid extra fields, and ``vllm.config.utils.replace`` rebuilds a config from its
instance ``__dict__`` and rejects unknown keys there. So the KV-transfer config is attached in a
per-process side table keyed by the config object, and carried through pickling (the engine
core sends ``VllmConfig`` to every worker) by ``__getstate__``/``__setstate__`` installed by
``patches/config_speculative.py``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, ParallelConfig, SpeculativeConfig

#: Connectors whose PP>1 producer path with a context-only drafter is not proven correct.
NIXL_CONNECTORS: tuple[str, ...] = ("NixlConnector", "NixlPullConnector", "NixlPushConnector")

#: The supported path for PP>1 DSpark prefill-only producers.
SUPPORTED_PP_PRODUCER_CONNECTOR = "MooncakeConnector"

#: Key under which the attached KV-transfer config travels in a pickled SpeculativeConfig.
STATE_KEY = "__vllm_dspark_pp_kv_transfer_config__"

_UNSET: Any = object()
# id(spec_config) -> (weak reference to spec_config, attached KVTransferConfig or None)
_ATTACHED: dict[int, tuple[weakref.ref, Any]] = {}


# --------------------------------------------------------------------------- attachment
def attach_kv_transfer_config(
    spec_config: SpeculativeConfig, kv_transfer_config: KVTransferConfig | None
) -> None:
    """Record which KV-transfer config belongs to ``spec_config`` (this process only;
    pickling carries it through ``__getstate__``/``__setstate__``)."""
    key = id(spec_config)

    def _forget(_ref: weakref.ref, key: int = key) -> None:
        entry = _ATTACHED.get(key)
        if entry is not None and entry[0] is _ref:
            del _ATTACHED[key]

    _ATTACHED[key] = (weakref.ref(spec_config, _forget), kv_transfer_config)


def is_attached(spec_config: SpeculativeConfig) -> bool:
    entry = _ATTACHED.get(id(spec_config))
    if entry is not None and entry[0]() is spec_config:
        return True
    return STATE_KEY in getattr(spec_config, "__dict__", {})


def attached_kv_transfer_config(spec_config: SpeculativeConfig) -> KVTransferConfig | None:
    """The KV-transfer config attached to ``spec_config``, or None."""
    entry = _ATTACHED.get(id(spec_config))
    if entry is not None and entry[0]() is spec_config:
        return entry[1]
    # Unpickled before our __setstate__ was installed: the value landed in __dict__.
    # Move it to the side table so vllm.config.utils.replace keeps working.
    d = getattr(spec_config, "__dict__", {})
    if STATE_KEY in d:
        value = d.pop(STATE_KEY)
        attach_kv_transfer_config(spec_config, value)
        return value
    return None


# --------------------------------------------------------------------------- roles
def is_pure_kv_producer(kv_transfer_config: KVTransferConfig | None) -> bool:
    """A connector is configured and this instance only produces KV (never consumes)."""
    if kv_transfer_config is None or kv_transfer_config.kv_connector is None:
        return False
    return bool(kv_transfer_config.is_kv_producer) and not kv_transfer_config.is_kv_consumer


def is_dspark_prefill_only(
    spec_config: SpeculativeConfig | None, kv_transfer_config: Any = _UNSET
) -> bool:
    """DSpark speculative decoding on a pure KV producer (``kv_role=kv_producer``).

    ``kv_transfer_config`` defaults to the one attached to ``spec_config``.
    """
    if spec_config is None or getattr(spec_config, "method", None) != "dspark":
        return False
    if kv_transfer_config is _UNSET:
        kv_transfer_config = attached_kv_transfer_config(spec_config)
    return is_pure_kv_producer(kv_transfer_config)


def target_pp_size(
    spec_config: SpeculativeConfig | None, parallel_config: ParallelConfig | None = None
) -> int:
    if parallel_config is None and spec_config is not None:
        parallel_config = getattr(spec_config, "target_parallel_config", None)
    if parallel_config is None:
        return 1
    return int(parallel_config.pipeline_parallel_size)


def use_dspark_last_stage_drafter(
    spec_config: SpeculativeConfig | None, parallel_config: ParallelConfig | None = None
) -> bool:
    """DSpark under a PP>1 target: the drafter lives on the last stage, draft-local PP=1.

    ``parallel_config`` is the target's (defaults to ``spec_config.target_parallel_config``).
    """
    if spec_config is None or getattr(spec_config, "method", None) != "dspark":
        return False
    return target_pp_size(spec_config, parallel_config) > 1


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
