"""Expose the DSpark producer roles on vLLM's SpeculativeConfig.

WHAT: Adds ``SpeculativeConfig.is_dspark_prefill_only()`` and
``SpeculativeConfig.use_dspark_last_stage_drafter()`` (thin calls into
``vllm_dspark_pp.roles``), and ``__getstate__``/``__setstate__`` that carry the instance's
KV-transfer config (attached by ``patches/config_vllm.py``) through pickling to the workers.

WHY: A DSpark prefill-only producer must build a context-KV-only drafter, which needs to know
the instance's KV role; vLLM's SpeculativeConfig does not see the KV-transfer config, and its
pydantic dataclass forbids extra fields (and ``vllm.config.utils.replace`` rejects unknown keys
in ``__dict__``), so the link lives in a side table that the pickle state carries.

UPSTREAM: vLLM PR #56957 (DSpark prefill-only producers under PP).

RETIRE WHEN: vLLM's SpeculativeConfig knows the KV role of its instance (the upstream PR lands).

TESTED BY: tests/unit/producer/test_roles.py, tests/unit/producer/test_config_patch.py,
tests/e2e/producer/test_pd_producer_cpu.py
"""

from __future__ import annotations

TARGET = "vllm.config.speculative"


def apply() -> None:
    from vllm.config.speculative import SpeculativeConfig

    from vllm_dspark_pp import roles

    if getattr(SpeculativeConfig, "_vllm_dspark_pp_roles", False):
        return

    def is_dspark_prefill_only(self) -> bool:
        """DSpark on a pure KV producer (kv_role='kv_producer'): context-KV-only drafter."""
        return roles.is_dspark_prefill_only(self)

    def use_dspark_last_stage_drafter(self) -> bool:
        """DSpark under a PP>1 target: drafts on the last stage with a draft-local PP=1."""
        return roles.use_dspark_last_stage_drafter(self)

    base_getstate = getattr(SpeculativeConfig, "__getstate__", None)

    def __getstate__(self):
        state = base_getstate(self) if base_getstate is not None else self.__dict__
        state = dict(state) if state is not None else {}
        if roles.is_attached(self):
            state[roles.STATE_KEY] = roles.attached_kv_transfer_config(self)
        return state

    def __setstate__(self, state):
        state = dict(state)
        has_kv = roles.STATE_KEY in state
        kv = state.pop(roles.STATE_KEY, None)
        self.__dict__.update(state)
        if has_kv:
            roles.attach_kv_transfer_config(self, kv)

    SpeculativeConfig.is_dspark_prefill_only = is_dspark_prefill_only
    SpeculativeConfig.use_dspark_last_stage_drafter = use_dspark_last_stage_drafter
    SpeculativeConfig.__getstate__ = __getstate__
    SpeculativeConfig.__setstate__ = __setstate__
    SpeculativeConfig._vllm_dspark_pp_roles = True
