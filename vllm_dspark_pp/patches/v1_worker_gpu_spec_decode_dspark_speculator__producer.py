"""The DSpark speculator on a prefill-only producer: context KV only.

WHAT: On a DSpark prefill-only producer (``producer.roles.prefill_only_role``), ``DSparkSpeculator``
loads the context-KV-only drafter (``producer.load.load_context_kv_model``) instead of the full
one, turns off the draft logits cache, adaptive verification and its acceptance estimator, and
gains ``materialize_context_kv()``: vLLM's own propose path with zero speculative tokens, which
stores the context hidden states and writes the draft's context KV, then returns without the
query pass. ``propose`` on such a speculator does only that, dummy proposes (profiling,
warm-up) do nothing, a request for real drafts raises ``ContextOnlyDrafterError``, and
``init_cudagraph_manager``/``capture`` capture no draft CUDA graphs. Off producers nothing
changes.

WHY: vLLM 0.34.0 builds the whole drafter on producers (embeddings, LM head, Markov and
confidence heads, MLPs, draft CUDA graphs) and only skips the query pass at run time; a
producer needs only the context KV its decoder pulls by layer name.

UPSTREAM: vLLM PR #56957 (DSpark prefill-only producers under PP).

RETIRE WHEN: upstream builds a context-only drafter for producers.

TESTED BY: tests/unit/producer/test_context_kv_qwen3.py, tests/e2e/producer/test_pd_producer_cpu.py,
tests/gpu/test_producer_gpu.py
"""

from __future__ import annotations

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.v1.worker.gpu.spec_decode.dspark.speculator"


def _patch(module) -> None:
    from vllm_dspark_pp.producer.drafter import ContextOnlyDrafterError
    from vllm_dspark_pp.producer.load import load_context_kv_model
    from vllm_dspark_pp.producer.roles import prefill_only_role

    cls = module.DSparkSpeculator
    if getattr(cls, "_vllm_dspark_pp_producer", False):
        return

    def make_init(orig):
        def __init__(self, vllm_config, device):
            orig(self, vllm_config, device)
            self.dspark_prefill_only = prefill_only_role(vllm_config)
            if self.dspark_prefill_only:
                # Nothing on a producer verifies these drafts.
                self.use_draft_logits = False
                self.enable_adaptive_verification = False
                self.use_acceptance_estimator = False

        return __init__

    def make_load_draft_model(orig):
        def load_draft_model(self, target_model, target_attn_layer_names):
            if not getattr(self, "dspark_prefill_only", False):
                return orig(self, target_model, target_attn_layer_names)
            self.use_confidence_head = False
            return load_context_kv_model(target_model, self.vllm_config)

        return load_draft_model

    def make_propose(orig):
        def propose(self, *args, **kwargs):
            if not getattr(self, "dspark_prefill_only", False):
                return orig(self, *args, **kwargs)
            if kwargs.get("dummy_run", False):
                # Profiling / warm-up: no draft work on a producer.
                batch = args[0] if args else kwargs["input_batch"]
                return self.draft_tokens[: batch.num_reqs]
            n = kwargs.get("num_speculative_tokens")
            if n:
                raise ContextOnlyDrafterError(
                    f"propose(num_speculative_tokens={n}) on a prefill-only producer: the "
                    "context-KV-only DSpark drafter cannot draft tokens (the producer model "
                    "runner patch schedules zero drafts; is it applied?)"
                )
            return self.materialize_context_kv(*args, **kwargs)

        return propose

    base_propose = cls.propose  # DFlashSpeculator.propose (vLLM's own path)

    def materialize_context_kv(self, *args, **kwargs):
        """Write the draft's context KV for this batch without generating tokens.

        Same arguments as ``propose``; runs vLLM's propose with ``num_speculative_tokens=0``
        (dflash/speculator.py, the "No drafts are needed" branch): input preparation, the
        hidden-state store and ``precompute_and_store_context_kv``; no query pass.
        """
        kwargs["num_speculative_tokens"] = 0
        kwargs.pop("dummy_run", None)
        return base_propose(self, *args, **kwargs)

    def make_init_cg(orig):
        def init_cudagraph_manager(self, cudagraph_mode):
            if getattr(self, "dspark_prefill_only", False):
                self.query_cudagraph_manager = None
                return
            return orig(self, cudagraph_mode)

        return init_cudagraph_manager

    def make_capture(orig):
        def capture(self):
            if getattr(self, "dspark_prefill_only", False):
                return
            return orig(self)

        return capture

    cls.materialize_context_kv = materialize_context_kv
    wrap(cls, "__init__", make_init)
    wrap(cls, "load_draft_model", make_load_draft_model)
    wrap(cls, "propose", make_propose)
    wrap(cls, "init_cudagraph_manager", make_init_cg)
    wrap(cls, "capture", make_capture)
    cls._vllm_dspark_pp_producer = True


def apply() -> None:
    when_imported(TARGET, _patch)
