"""The scheduler of a DSpark prefill-only producer schedules no drafts.

WHAT: Wraps ``Scheduler.__init__`` (so ``AsyncScheduler`` too): on a DSpark prefill-only producer
(``roles.is_dspark_prefill_only``) the scheduler's speculative token count is set to 0 and
dynamic speculative decoding is switched off, so every ``SchedulerOutput`` carries
``num_spec_tokens_to_schedule == 0``, no request gets draft placeholders and no decode step
verifies drafts. The KV-cache layout (draft KV groups included) is untouched: it comes from the
KV-cache config, not from this count. Everywhere else nothing changes.

WHY: The producer's drafter is context-KV-only and proposes nothing, yet vLLM 0.34.0's async
scheduler gives every decoding request ``num_speculative_tokens`` placeholder drafts
(``vllm/v1/core/sched/async_scheduler.py:22-41``). The model runner fills those slots from its
draft buffer, which a zero-draft propose leaves at ``-1`` (``vllm/v1/worker/gpu/model_runner.py:
2388-2390``), and the target embeds token id ``-1``: ``IndexError`` on CPU, a device-side assert
on CUDA. A producer asked for more than one token must decode like a plain engine.

UPSTREAM: vLLM PR #56957 (DSpark prefill-only producers under PP).

RETIRE WHEN: upstream's scheduler knows that a DSpark prefill-only producer has no drafter.

TESTED BY: tests/unit/producer/test_runner_patches.py, tests/e2e/producer/test_producer_decodes_cpu.py
"""

from __future__ import annotations

from vllm_dspark_pp.patches._on_import import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.v1.core.sched.scheduler"


def producer_schedules_no_drafts(scheduler, vllm_config) -> bool:
    """Zero the draft count of ``scheduler`` when ``vllm_config`` is a DSpark prefill-only
    producer; return whether it did."""
    from vllm_dspark_pp.roles import is_dspark_prefill_only

    if not is_dspark_prefill_only(vllm_config.speculative_config, vllm_config.kv_transfer_config):
        return False
    scheduler.num_spec_tokens = 0
    scheduler.dynamic_sd_lookup = None
    return True


def _patch(module) -> None:
    from vllm.logger import init_logger

    logger = init_logger("vllm.dspark_pp.producer")

    def make_init(orig):
        def __init__(self, vllm_config, *args, **kwargs):
            orig(self, vllm_config, *args, **kwargs)
            if producer_schedules_no_drafts(self, vllm_config):
                logger.info(
                    "DSpark prefill-only producer: the scheduler schedules no draft tokens "
                    "(the context-KV-only drafter writes context KV and proposes nothing)."
                )

        return __init__

    wrap(module.Scheduler, "__init__", make_init)


def apply() -> None:
    when_imported(TARGET, _patch)
