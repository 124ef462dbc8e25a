"""The model runner on a DSpark prefill-only producer.

WHAT: On a DSpark prefill-only producer (kv_role='kv_producer', method 'dspark'), wraps
``GPUModelRunner``: ``load_model`` leaves the rejection sampler unbuilt; ``sample`` builds it
on first need only (a batch that carries draft tokens: vLLM's kernel warm-up schedules some,
and async scheduling adds -1 placeholders; those drafts are never the producer's own, so they
are all rejected and output is unchanged); ``execute_model`` schedules zero drafts on every PP
rank, so the last stage's speculator runs only ``materialize_context_kv()`` and no rank waits
for a draft broadcast; ``sample_tokens`` leaves no ``-1`` in the runner's draft buffer (vLLM marks
unproposed draft slots ``-1``, ``model_runner.py:2388-2390``), so a batch that still carries
draft slots -- only vLLM's kernel warm-up builds one, since the scheduler patch
(``v1_core_sched_scheduler``) schedules none on producers -- feeds the target valid token ids.
Draft CUDA-graph capture, draft dummy proposes and adaptive verification
are switched off in the speculator patch
(``v1_worker_gpu_spec_decode_dspark_speculator__producer``), EPLB
registration of the draft in ``v1_worker_gpu_eplb_utils``.

WHY: A producer never verifies drafts it proposed; vLLM 0.34.0 still sets up the whole draft
machinery there.

UPSTREAM: vLLM PR #56957 (DSpark prefill-only producers under PP).

RETIRE WHEN: upstream model runner has a producer role for DSpark.

TESTED BY: tests/unit/producer/test_runner_patches.py, tests/e2e/producer/test_pd_producer_cpu.py,
tests/e2e/producer/test_producer_decodes_cpu.py, tests/gpu/test_producer_gpu.py
"""

from __future__ import annotations

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.v1.worker.gpu.model_runner"


def _is_producer(runner) -> bool:
    from vllm_dspark_pp.producer.roles import prefill_only_role

    return prefill_only_role(runner.vllm_config)


def valid_draft_buffer(runner) -> None:
    """Replace the ``-1`` marks of unproposed drafts in the runner's draft buffer by token 0.

    A producer never verifies these drafts (any value is lossless: the rejection sampler
    replaces a rejected draft by the target's token), but they are embedded as input ids when
    a batch carries draft slots, so they must be in the vocabulary."""
    states = getattr(runner, "req_states", None)
    buf = getattr(states, "draft_tokens", None)
    if buf is not None and buf.numel():
        buf.clamp_(min=0)


def _patch(module) -> None:
    from vllm.logger import init_logger

    logger = init_logger("vllm.dspark_pp.producer")
    cls = module.GPUModelRunner

    def make_load_model(orig):
        def load_model(self, *args, **kwargs):
            result = orig(self, *args, **kwargs)
            self.dspark_prefill_only = _is_producer(self)
            if self.dspark_prefill_only:
                self.rejection_sampler = None
                logger.info(
                    "DSpark prefill-only producer: context-KV-only drafter, no rejection "
                    "sampler, no draft CUDA graphs, no adaptive verification."
                )
            return result

        return load_model

    def make_sample(orig):
        def sample(self, hidden_states, input_batch, grammar_output):
            if (
                getattr(self, "dspark_prefill_only", False)
                and self.rejection_sampler is None
                and input_batch.num_draft_tokens > 0
                and self.sampler is not None
            ):
                logger.info(
                    "DSpark prefill-only producer got a batch with draft tokens (warm-up or "
                    "async placeholders); building the rejection sampler for it."
                )
                # Mirrors model_runner.py load_model (vLLM 0.34.0, lines 535-543).
                self.rejection_sampler = module.RejectionSampler(
                    self.sampler,
                    self.speculative_config,
                    self.device,
                    watermark_key=module.speculative_target_watermark_key(
                        self.vllm_config.watermark_config
                    ),
                )
            return orig(self, hidden_states, input_batch, grammar_output)

        return sample

    def make_execute_model(orig):
        def execute_model(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            state = getattr(self, "execute_model_state", None)
            if (
                getattr(self, "dspark_prefill_only", False)
                and state is not None
                and state.num_spec_tokens_to_schedule
            ):
                # Every rank decides this from the same config, so the PP draft broadcast
                # (sent only when drafts are proposed) is skipped on all of them alike. Done
                # where vLLM builds the state (model_runner.py 2190-2203, vLLM 0.34.0), so every
                # later reader -- sample_tokens and the PP exchange schedule -- sees zero drafts.
                self.execute_model_state = state._replace(num_spec_tokens_to_schedule=0)
            return out

        return execute_model

    def make_sample_tokens(orig):
        def sample_tokens(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            if getattr(self, "dspark_prefill_only", False):
                valid_draft_buffer(self)
            return out

        return sample_tokens

    wrap(cls, "load_model", make_load_model)
    wrap(cls, "sample", make_sample)
    wrap(cls, "execute_model", make_execute_model)
    wrap(cls, "sample_tokens", make_sample_tokens)


def apply() -> None:
    when_imported(TARGET, _patch)
