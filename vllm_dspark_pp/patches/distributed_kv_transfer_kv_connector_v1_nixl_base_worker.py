"""NIXL handshake failures that name the DSpark draft layers and the fix (issue 18).

WHAT: Three wraps in vLLM's NIXL worker module (pull and push workers share them):
(1) ``compute_nixl_compatibility_hash`` as the worker calls it also records the hash this
instance would have without its speculative config (vLLM's own function over a config view);
(2) ``NixlBaseConnectorWorker._nixl_handshake``: a "NIXL compatibility hash mismatch" of a DSpark
instance is re-raised with a hint; when the peer's hash equals this instance's hash without
speculation it says the prefiller runs no speculative decoding (vLLM issue #48221) and names the
fix (the same ``--speculative-config`` on the prefiller: a prefill-only producer builds only the
draft's context-KV layers); (3) ``NixlBaseConnectorWorker._pair_regions``: before vLLM pairs the
peer's KV regions by layer name, the two layer lists are compared
(``nixl_layers.layer_mismatch_problem``, exactly vLLM's rule) and a mismatch raises a
RuntimeError naming both lists' first difference in model order, the target/draft layer counts
of each side and the fix; a match logs the paired target and draft layer counts.

WHY: With DSpark only on the decoder, vLLM 0.34.0 fails the handshake with an opaque hash
mismatch, and with the check disabled (as its message suggests) with "Engine ... does not hold
the KV layers [...]"; older releases said "Number of KV layers must match" (#48221). None says
that the draft's KV layers are missing on the prefiller or how to get them there without
building the whole drafter. Behaviour is unchanged otherwise: the patch raises only where vLLM
raises, with a better message, and never on a handshake vLLM accepts.

UPSTREAM: vLLM issue #48221 (DSpark with NIXL P/D); no upstream PR yet.

RETIRE WHEN: vLLM's NIXL handshake names missing draft KV layers and DSpark prefill-only
producers exist upstream (vLLM PR #56957).

TESTED BY: tests/unit/connectors/test_nixl_handshake.py (the comparison, the hint, and the patched
``_pair_regions`` / ``_nixl_handshake`` on a CPU worker stand-in), tests/gpu/test_pd_nixl.py
"""

from __future__ import annotations

import threading

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"

_lock = threading.Lock()
#: this process's NIXL compatibility hash -> the same hash without the speculative config
_WITHOUT_SPEC: dict[str, str] = {}


def hash_without_spec(compat_hash: str | None) -> str | None:
    with _lock:
        return _WITHOUT_SPEC.get(compat_hash) if compat_hash else None


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.dspark_pp.nixl")


def _patch(module) -> None:
    from vllm_dspark_pp.connectors import nixl_layers

    def make_hash(orig):
        def compute_nixl_compatibility_hash(vllm_config, *args, **kwargs):
            value = orig(vllm_config, *args, **kwargs)
            if getattr(vllm_config, "speculative_config", None) is not None:
                try:
                    plain = nixl_layers.hash_without_speculation(orig, vllm_config, *args, **kwargs)
                except Exception as e:  # noqa: BLE001 - a diagnostic must never break start-up
                    _logger().debug("no speculation-free NIXL hash: %s", e)
                else:
                    with _lock:
                        _WITHOUT_SPEC[value] = plain
            return value

        return compute_nixl_compatibility_hash

    def make_handshake(orig):
        def _nixl_handshake(self, *args, **kwargs):
            try:
                return orig(self, *args, **kwargs)
            except RuntimeError as e:
                text = str(e)
                if "compatibility hash mismatch" not in text:
                    raise
                spec = getattr(getattr(self, "vllm_config", None), "speculative_config", None)
                hint = nixl_layers.hash_mismatch_hint(
                    getattr(spec, "method", None),
                    nixl_layers.remote_hash_in(text),
                    hash_without_spec(getattr(self, "compat_hash", None)),
                )
                if hint is None:
                    raise
                raise RuntimeError(f"{text} {hint}") from e

        return _nixl_handshake

    def make_pair(orig):
        def _pair_regions(self, nixl_agent_meta):
            members = getattr(nixl_agent_meta, "region_members", None) or []
            if members and len(members) == len(nixl_agent_meta.kv_caches_base_addr):
                local = nixl_layers.kv_layer_names([self._regions_by_layer.keys()])
                remote = nixl_layers.kv_layer_names(members)
                try:
                    n_target = int(self.model_config.get_total_num_hidden_layers())
                except Exception:  # noqa: BLE001 - counts are only for the message
                    n_target = None
                problem = nixl_layers.layer_mismatch_problem(
                    local,
                    remote,
                    remote_may_hold_more=getattr(self, "pp_size", 1) > 1,
                    num_target_layers=n_target,
                    remote_engine_id=str(nixl_agent_meta.engine_id),
                )
                if problem is not None:
                    raise RuntimeError(problem)
                if n_target is not None:
                    draft = [n for n in local if nixl_layers.is_draft_layer(n, n_target)]
                    _logger().info(
                        nixl_layers.PAIRED_LOG,
                        nixl_agent_meta.engine_id,
                        len(local) - len(draft),
                        len(draft),
                        f" ({', '.join(draft)})" if draft else "",
                    )
            return orig(self, nixl_agent_meta)

        return _pair_regions

    wrap(module, "compute_nixl_compatibility_hash", make_hash)
    cls = module.NixlBaseConnectorWorker
    wrap(cls, "_nixl_handshake", make_handshake)
    wrap(cls, "_pair_regions", make_pair)


def apply() -> None:
    when_imported(TARGET, _patch)
